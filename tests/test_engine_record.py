"""`pwruntime record-trace`: recorded traces are valid, deterministic, and carry the model's real routing."""
from __future__ import annotations

import numpy as np
import pytest

from pwruntime.cli import main
from traces.io import read_trace_dir
from traces.schema import check_routing_against_requests

TEXT = {
    "verse": "And the LORD spake unto Moses, saying, Speak unto the children of Israel. " * 20,
    "code": "The os module provides a portable way of using operating system dependent functionality. " * 20,
}


def _record(tmp_path, name, *extra):
    files = []
    for dom, text in TEXT.items():
        path = tmp_path / f"{dom}.txt"
        path.write_text(text)
        files += ["--data", f"{dom}={path}"]
    return main(["record-trace", *files, "--out", str(tmp_path / name), "--requests-per-domain", "3",
                 "--prompt-tokens", "8,24", "--output-tokens", "4,8", "--seed", "3", *extra])


def test_recorded_trace_is_valid_and_deterministic(tmp_path):
    assert _record(tmp_path, "a") == 0 and _record(tmp_path, "b") == 0
    a, b = read_trace_dir(tmp_path / "a"), read_trace_dir(tmp_path / "b")
    check_routing_against_requests(a.routing, a.requests)
    assert sorted(set(a.requests.domain)) == ["code", "verse"] and len(a.requests) == 6
    assert a.routing.card == "PagedWeight-demo" and a.routing.has_features
    assert np.all(np.diff(a.requests.arrival_s) >= 0)
    np.testing.assert_array_equal(a.routing.expert_ids, b.routing.expert_ids)
    np.testing.assert_array_equal(a.requests.output_tokens, b.requests.output_tokens)
    mass = a.routing.routing_mass()
    np.testing.assert_allclose(mass.sum(axis=1), 1.0, rtol=1e-6)
    # every request's prompt and output positions are routed in every MoE layer
    assert len(a.routing) == int((a.requests.prompt_tokens + a.requests.output_tokens - 1).sum()) * 4


def test_a_range_of_one_length_gives_requests_of_exactly_that_length(tmp_path):
    assert _record(tmp_path, "one", "--prompt-tokens", "8,8", "--output-tokens", "4,4") == 0
    requests = read_trace_dir(tmp_path / "one").requests
    assert set(requests.prompt_tokens.tolist()) == {8} and set(requests.output_tokens.tolist()) == {4}
    ids = requests.request_id.tolist()   # in arrival order: the requests were submitted as they arrive
    assert ids == sorted(ids)


@pytest.mark.parametrize("extra, needle", [
    (["--prompt-tokens", "9"], "MIN,MAX"),
    (["--output-tokens", "5,2"], "MIN <= MAX"),
    (["--rate", "0"], "--rate"),
])
def test_bad_options_exit_2(tmp_path, capsys, extra, needle):
    assert _record(tmp_path, "x", *extra) == 2
    err = capsys.readouterr().err
    assert needle in err and "Traceback" not in err
    assert not (tmp_path / "x").exists()


def test_missing_text_exit_2(tmp_path, capsys):
    assert main(["record-trace", "--data", f"a={tmp_path / 'nope.txt'}", "--out", str(tmp_path / "o")]) == 2
    assert "nope.txt" in capsys.readouterr().err


def test_a_domain_needs_more_tokens_than_the_longest_prompt(tmp_path, capsys):
    """A prompt is cut from a random place before the text's last token: a domain of n tokens takes prompts of up to
    n - 1 tokens, and one of n is refused with a clear error (no crash, nothing written)."""
    from pwruntime.cmd_perplexity import default_model_dir, read_text
    from pwruntime.model import load_model

    path = tmp_path / "verse.txt"
    path.write_text(TEXT["verse"][:150])
    n = len(load_model(default_model_dir()).tokenizer.encode(read_text(path), add_special_tokens=False))

    def record(name, tokens):
        return main(["record-trace", "--data", f"verse={path}", "--out", str(tmp_path / name), "--requests-per-domain",
                     "2", "--prompt-tokens", f"{tokens},{tokens}", "--output-tokens", "2,2"])
    assert record("whole", n) == 2
    err = capsys.readouterr().err
    assert f"has only {n} tokens; it needs more than {n}" in err and "Traceback" not in err
    assert not (tmp_path / "whole").exists()
    assert record("fits", n - 1) == 0
    assert set(read_trace_dir(tmp_path / "fits").requests.prompt_tokens.tolist()) == {n - 1}
