"""Trip counts of `while` loops: XLA's `known_trip_count`, else read from the loop itself (`i < N` in the
condition, `i`'s initial constant in the caller, its step the constant the body adds)."""
from __future__ import annotations

import re

_TRIP = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)')


def _constant(instrs: dict, name: str):
    """Integer value of `name` if it is a scalar constant (through copies/bitcasts/converts), else None."""
    for _ in range(8):
        if name not in instrs:
            return None
        shape, opcode, operands, raw, _ = instrs[name]
        if opcode == "constant":
            try:
                return int(raw.strip())
            except ValueError:
                return None
        if opcode not in ("copy", "bitcast", "convert") or len(operands) != 1:
            return None
        name = operands[0]
    return None


def trip_count(comps: dict, caller: str, while_operands: list[str], attrs: str, cond: str, body: str = ""):
    """Iterations of a while loop: XLA's known_trip_count, else `i < N` (or <=) in the condition with the
    counter's initial value a constant in the caller and its step the constant the body adds to it
    (`i = i + s`, s > 0); None when these cannot be read."""
    m = _TRIP.search(attrs)
    if m:
        return int(m.group(1))
    instrs = comps.get(cond, {})
    root = list(instrs.values())[-1] if instrs else None
    if root is None or root[1] != "compare" or len(root[2]) != 2:
        return None
    direction = re.search(r"direction=(\w+)", root[4])
    a, b = root[2]
    if _constant(instrs, a) is not None:          # N > i  ==  i < N
        a, b = b, a
        direction = {"GT": "LT", "GE": "LE"}.get(direction.group(1)) if direction else None
    else:
        direction = direction.group(1) if direction else None
    limit = _constant(instrs, b)
    counter = instrs.get(a)
    if limit is None or counter is None or counter[1] != "get-tuple-element" or direction not in ("LT", "LE"):
        return None
    index = int(re.search(r"index=(\d+)", counter[4]).group(1))
    init_tuple = comps[caller].get(while_operands[0]) if while_operands else None
    if init_tuple is None or init_tuple[1] != "tuple" or index >= len(init_tuple[2]):
        return None
    start = _constant(comps[caller], init_tuple[2][index])
    step = _counter_step(comps.get(body, {}), index)
    if start is None or step is None:
        return None
    span = limit - start + (direction == "LE")        # values start, start+step, ... below the bound
    return max(0, -(-span // step))


def _through_copies(instrs: dict, name: str) -> str:
    for _ in range(4):
        if name not in instrs or instrs[name][1] not in ("copy", "convert", "bitcast") or not instrs[name][2]:
            break
        name = instrs[name][2][0]
    return name


def _counter_step(instrs: dict, index: int):
    """The constant s > 0 a loop body adds to tuple element `index` of its parameter (the body's root
    tuple holds add(get-tuple-element(param, index), s) there); None when it is anything else."""
    if not instrs:
        return None
    root = list(instrs.values())[-1]
    if root[1] != "tuple" or index >= len(root[2]):
        return None
    name = _through_copies(instrs, root[2][index])
    if name not in instrs or instrs[name][1] != "add" or len(instrs[name][2]) != 2:
        return None
    for counter, other in (instrs[name][2], instrs[name][2][::-1]):
        gte = instrs.get(_through_copies(instrs, counter))
        step = _constant(instrs, other)
        if gte is not None and gte[1] == "get-tuple-element" and step is not None and step > 0 \
                and re.search(rf"index={index}\b", gte[4]):
            return step
    return None


