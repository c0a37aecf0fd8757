"""How a memory budget splits between the model's weights, the KV pool and the allocator's slack.

Both engines take one budget (`pwsim run --budget`, `pwruntime ... --gpu-memory-budget`): the model's weights (the
non-expert ones at 16 bits, the routed experts at the policy's starting bits: `policies.planners.weight_bytes`) and
the KV cache, with some slack kept out of the pool for the LUTs of transitions in flight and fragmentation. The
pool starts with what is left; afterwards it grows by the bytes offloads free and shrinks by those reloads take, so
the sum stays in the budget. A step's activations take the budget's `activation_bytes` (the runtime measures them
by a profiling forward of the largest step, `pwruntime.activation_profile`; the simulator takes what a replay measured,
`pwsim run --activation-reserve`), kept out of the pool as the slack is, and never lent.

A prefill step's MoE layer dequantizes its experts to 16 bits a chunk at a time, at most `prefill_chunk_bytes` of them
alive at once (`--prefill-chunk` in both engines, default `DEFAULT_PREFILL_CHUNK_BYTES`): part of the activations,
and what sets how many chunks a layer takes (`prefill_chunk_experts`), each costing its own launches.

`LUT_ROOMS`: where an offload's lower-bitwidth LUT finds room while the offload is in flight, an engine setting
(`--lut-room`): "slack", borrowed from the allocator slack (policies.loop), or "pool", the KV pool shrunk over free
blocks for it and grown again when the offload lands (every runtime and simulation before session 38).
"""
from __future__ import annotations

MiB = 1 << 20
LUT_ROOMS = ("slack", "pool")
DEFAULT_PREFILL_CHUNK_BYTES = 1 << 30  # dequantized expert weights a prefill layer holds at once


def prefill_chunk_experts(hidden: int, intermediate: int, element_size: int,
                          chunk_bytes: int = DEFAULT_PREFILL_CHUNK_BYTES) -> int:
    """Experts of `hidden` x `intermediate` (gate, up and down: 3 * hidden * intermediate elements of `element_size`
    bytes each) whose dequantized weights fit one prefill chunk of `chunk_bytes`; at least one."""
    return max(1, chunk_bytes // (3 * hidden * intermediate * element_size))


def prefill_chunks(experts: int, hidden: int, intermediate: int, element_size: int,
                   chunk_bytes: int = DEFAULT_PREFILL_CHUNK_BYTES) -> int:
    """The chunks a prefill MoE layer of `experts` experts takes them in, `prefill_chunk_experts` at a time."""
    return -(-experts // prefill_chunk_experts(hidden, intermediate, element_size, chunk_bytes))


def allocator_slack_bytes(budget_bytes: int) -> int:
    """The slack a budget keeps out of the KV pool: 64 MiB, or 1/32 of a budget under 2 GiB."""
    return min(64 * MiB, budget_bytes // 32)


def lut_slack_bytes(lut_room: str, slack_bytes: int) -> int:
    """The slack an engine's plan loop may lend offloads' LUTs in flight (`PlanLoop(lut_slack_bytes=)`): all of
    `slack_bytes` under "slack", none under "pool". Raises ValueError for a room not in LUT_ROOMS."""
    if lut_room not in LUT_ROOMS:
        raise ValueError(f"lut_room must be one of {LUT_ROOMS}, got {lut_room!r}")
    return slack_bytes if lut_room == "slack" else 0


def kv_room_bytes(budget_bytes: int, weight_bytes: int, slack_bytes: int | None = None,
                  activation_bytes: int = 0) -> int:
    """What the budget leaves the KV pool at the start (negative: the weights, the slack and the activations alone
    exceed it); `weight_bytes`: every weight the budget holds, non-expert and routed experts; `slack_bytes` None:
    allocator_slack_bytes(budget_bytes); `activation_bytes`: the activation reserve (module docstring)."""
    slack = allocator_slack_bytes(budget_bytes) if slack_bytes is None else slack_bytes
    return budget_bytes - slack - activation_bytes - weight_bytes
