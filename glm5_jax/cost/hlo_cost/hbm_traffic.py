"""HBM bytes of one top-level instruction (`instruction_bytes`): operands and result at their tiled sizes;
windows (slices, gathers, scatters, in-place updates) by the tiles they touch; a fusion by what its fused
computation reads through each parameter and writes; a fusion around Mosaic kernels by the kernels' declared
bytes; an async copy or collective once."""
from __future__ import annotations

import math

from glm5_jax.cost.hlo_cost.collective_ops import ASYNC_TUPLE_COLLECTIVES, collectives_in
from glm5_jax.cost.hlo_cost.kernels import kernel_cost
from glm5_jax.cost.hlo_cost.parsing import (Array, callees_of, first_array, hbm_bytes, int_attr, ints_attr, laid_out,
                                            parameter_names)


def _index_count(indices: Array, attrs: str) -> int:
    """Slices a gather reads (updates a scatter writes): the index array's elements over its index vector."""
    dim = int_attr(attrs, "index_vector_dim", len(indices.shape))
    per_index = indices.shape[dim] if dim < len(indices.shape) else 1
    return math.prod(indices.shape) // max(per_index, 1)


def gather_read_bytes(operand: Array, indices: Array, attrs: str) -> int:
    """HBM bytes a gather reads from its operand: every slice rounded up to the operand's tiles (a single
    row of a T(8,128) array reads the 8-row tile it lies in)."""
    return _index_count(indices, attrs) * operand.hbm_bytes(ints_attr(attrs, "slice_sizes"))


def scatter_window(operand: Array, updates: Array, attrs: str) -> tuple[int, list[int]]:
    """(updates written, the operand window each one touches) of a scatter."""
    window_sizes = [updates.shape[d] for d in ints_attr(attrs, "update_window_dims")]
    skipped = set(ints_attr(attrs, "inserted_window_dims")) | set(ints_attr(attrs, "input_batching_dims"))
    sizes = iter(window_sizes)
    window = [1 if d in skipped else next(sizes, 1) for d in range(len(operand.shape))]
    count = math.prod(updates.shape) // max(math.prod(window_sizes), 1)
    return count, window


def scatter_touched_bytes(operand: Array, updates: Array, attrs: str) -> int:
    """HBM bytes a scatter reads and writes in its operand (in place): each update's window rounded up to
    the operand's tiles, read and written back."""
    count, window = scatter_window(operand, updates, attrs)
    return 2 * count * operand.hbm_bytes(window)


def update_slice_bytes(operand: Array, update: Array) -> int:
    """HBM bytes a dynamic-update-slice writes into its operand: the update's window at DMA granularity
    (in place: the rest of the operand is not touched)."""
    return operand.hbm_bytes(update.shape, "dma")


def _slice_users(comps: dict, instrs: dict, name: str, depth: int = 0):
    """HBM bytes read through `name` when every use reads a window of it (dynamic-slice, gather: the tiles
    the windows touch), updates it in place (dynamic-update-slice: counted with the write; scatter: the
    touched tiles read and written), or passes it on to such uses; None when some use reads it whole."""
    total = 0
    users = [(n, i) for n, i in instrs.items() if name in i[2]]
    if not users or depth > 4:
        return None
    array = first_array(instrs[name][0]) if name in instrs else None
    for uname, (shape, opcode, operands, _, attrs) in users:
        first = operands[0] == name and array is not None
        if opcode == "dynamic-slice" and first:
            total += array.hbm_bytes(first_array(shape).shape, "dma")
        elif opcode == "gather" and first and len(operands) > 1 and operands[1] in instrs:
            total += gather_read_bytes(array, first_array(instrs[operands[1]][0]), attrs)
        elif opcode == "scatter" and first and len(operands) > 2 and operands[2] in instrs:
            total += scatter_touched_bytes(array, first_array(instrs[operands[2]][0]), attrs)
        elif opcode == "dynamic-update-slice" and operands[0] == name:
            pass
        elif opcode == "bitcast":
            sub = _slice_users(comps, instrs, uname, depth + 1)
            if sub is None:
                return None
            total += sub
        elif opcode == "fusion" and callees_of(attrs).get("calls") in comps:
            inner = comps[callees_of(attrs)["calls"]]
            inner_params = parameter_names(inner)
            for j, o in enumerate(operands):
                sub = _slice_users(comps, inner, inner_params[j], depth + 1) if o == name and j in inner_params else 0
                if sub is None:
                    return None
                total += sub
        else:
            return None
    return total


def _written_bytes(instrs: dict, name: str, depth: int = 0) -> int:
    """HBM bytes a fused computation's value `name` writes: an in-place dynamic-update-slice its update's
    tiles, an in-place scatter nothing more (its touched tiles count with the operand), else the value."""
    shape, opcode, operands, _, _ = instrs[name]
    if opcode == "dynamic-update-slice" and len(operands) > 1 and operands[1] in instrs and operands[0] in instrs:
        return update_slice_bytes(first_array(instrs[operands[0]][0]), first_array(instrs[operands[1]][0]))
    if opcode == "scatter" and operands and instrs.get(operands[0], ("", ""))[1] == "parameter":
        return 0
    if opcode in ("tuple", "bitcast") and depth < 4 and all(o in instrs for o in operands):
        return sum(_written_bytes(instrs, o, depth + 1) for o in operands)
    return hbm_bytes(shape)


_PASS_THROUGH = ("bitcast", "reshape", "get-tuple-element")


def _fusion_outputs(instrs: dict) -> tuple[str, list[str]]:
    """(root, the values a fused computation returns): the root tuple's operands, or the root itself."""
    root = list(instrs)[-1]
    _, op, operands, _, _ = instrs[root]
    return root, (operands if op == "tuple" else [root])


def _kernel_fusion_bytes(instrs: dict, full_in: list[int], params: dict[int, str]) -> int | None:
    """HBM bytes of a fusion the TPU compiler built around Mosaic kernels (kind=kCustom; e.g. a kernel whose
    output goes straight into a loop's stacked buffer through a dynamic-update-slice), when every kernel in
    it declares its bytes: the kernels' declared bytes (their reads and their writes, wherever they land),
    plus what the fusion's other instructions read and write. A parameter that only feeds kernels, or is
    only the buffer a dynamic-update-slice writes into in place, adds nothing more. None: not such a fusion."""
    kernels = {n for n, (_, op, _, _, attrs) in instrs.items() if op == "custom-call" and "tpu_custom_call" in attrs}
    if not kernels:
        return None
    declared = [kernel_cost(instrs[n][0], [], instrs[n][4]) for n in kernels]
    if any(d is None or d[1] is None for d in declared):
        return None
    nbytes = sum(d[1] for d in declared)

    def from_kernel(name, depth=0):             # a kernel's output, passed through bitcasts / tuple picks
        if name in kernels:
            return True
        _, op, operands, _, _ = instrs.get(name, ("", "", [], "", ""))
        return op in _PASS_THROUGH and depth < 8 and bool(operands) and from_kernel(operands[0], depth + 1)

    def only_aliased(name, depth=0):            # every use: a kernel operand, or the buffer updated in place
        users = [(u, i) for u, i in instrs.items() if name in i[2]]
        for uname, (_, op, operands, _, _) in users:
            if uname in kernels or (op == "dynamic-update-slice" and operands[0] == name):
                continue
            if op in _PASS_THROUGH and depth < 8 and only_aliased(uname, depth + 1):
                continue
            return False
        return bool(users)

    for i, full in enumerate(full_in):
        if full and i in params and not only_aliased(params[i]):
            nbytes += full
    for out in _fusion_outputs(instrs)[1]:
        _, o_op, o_operands, _, _ = instrs[out]
        if from_kernel(out) or (o_op == "dynamic-update-slice" and len(o_operands) > 1 and from_kernel(o_operands[1])):
            continue
        nbytes += _written_bytes(instrs, out)
    return nbytes


def instruction_bytes(comps, shape, opcode, operand_shapes, callees, attrs: str = "",
                       collective_part: str | None = None) -> float:
    """HBM bytes one top-level instruction reads and writes: operands and result at their tiled sizes,
    nothing for arrays in VMEM; windows (slices, gathers, scatters, in-place updates) by the tiles they
    touch; an async copy once (its source and its destination, not the aliased tuple); an async collective
    fusion's data once (``collective_part``: which of its fusions this is, `_collective_fusion_bytes`)."""
    arrays = [first_array(t) for t in operand_shapes]
    if opcode == "custom-call" and 'custom_call_target="AllocateBuffer"' in attrs:
        return 0                        # reserves a buffer (a loop's output stack); moves nothing
    if opcode == "dynamic-slice" and arrays and arrays[0] is not None:
        return arrays[0].hbm_bytes(first_array(shape).shape, "dma") + hbm_bytes(shape)
    if opcode == "dynamic-update-slice" and len(arrays) > 1 and None not in arrays[:2]:
        return update_slice_bytes(arrays[0], arrays[1]) + arrays[1].hbm_bytes()
    if opcode == "gather" and len(arrays) > 1 and None not in arrays[:2]:
        return gather_read_bytes(arrays[0], arrays[1], attrs) + arrays[1].hbm_bytes() + hbm_bytes(shape)
    if opcode == "scatter" and len(arrays) > 2 and None not in arrays[:3]:
        return scatter_touched_bytes(arrays[0], arrays[2], attrs) + arrays[1].hbm_bytes() + arrays[2].hbm_bytes()
    if opcode == "copy-start":
        destination = laid_out(shape)[:1]
        return sum(a.hbm_bytes() for a in destination) + sum(hbm_bytes(t) for t in operand_shapes)
    if opcode == "slice-start" and arrays and arrays[0] is not None and len(laid_out(shape)) > 1:
        # an async slice (v6e: a window copied into VMEM): the window read, the destination written
        destination = laid_out(shape)[1]        # ((operand), destination, s32)
        return arrays[0].hbm_bytes(destination.shape, "dma") + destination.hbm_bytes()
    if opcode.removesuffix("-start") in ASYNC_TUPLE_COLLECTIVES and opcode.endswith("-start") \
            and shape.startswith("("):
        # its result tuple holds its operands (the buffers it reads: aliased, not copies), its results and
        # sync flags (SMEM): each buffer once, the operands read and the results written
        return hbm_bytes(shape)
    full_in = [hbm_bytes(t) for t in operand_shapes]
    if opcode != "fusion" or callees.get("calls") not in comps:
        return hbm_bytes(shape) + sum(full_in)
    instrs = comps[callees["calls"]]
    params = parameter_names(instrs)
    if collective_part in ("start", "done"):
        return _collective_fusion_bytes(instrs, collective_part)
    in_kernel_fusion = _kernel_fusion_bytes(instrs, full_in, params)
    if in_kernel_fusion is not None:
        return in_kernel_fusion
    buffer_params, buffer_outputs = _collective_buffers(instrs) if collective_part == "compute" else (set(), set())
    if buffer_outputs:
        nbytes = sum(_written_bytes(instrs, o) for o in _fusion_outputs(instrs)[1] if o not in buffer_outputs)
    else:
        nbytes = _written_bytes(instrs, list(instrs)[-1]) if instrs else hbm_bytes(shape)
    for i, full in enumerate(full_in):
        if full == 0 or params.get(i) in buffer_params:   # off HBM (VMEM, SMEM), or the collective's buffer
            continue
        touched = _slice_users(comps, instrs, params[i]) if i in params else None
        nbytes += full if touched is None else touched
    return nbytes


def _collective_fusion_bytes(instrs: dict, part: str) -> int:
    """HBM bytes of the start or done fusion of an asynchronous collective as the TPU compiler writes it (its
    async collective fusion: a start fusion, a compute fusion the collective runs beside, a done fusion):
    the collective's data moves once, charged at the ``"start"`` fusion (its operands read, its result
    written); the ``"done"`` fusion only waits. The compute fusion: `_collective_buffers`."""
    if part == "done":
        return 0
    collectives = collectives_in(instrs)
    return sum(hbm_bytes(instrs[o][0]) for n in collectives for o in instrs[n][2] if o in instrs) + \
        sum(hbm_bytes(instrs[n][0]) for n in collectives)


def _collective_buffers(instrs: dict) -> tuple[set[str], set[str]]:
    """(parameters, results) of an async collective's compute fusion that are the collective's buffers, not
    the compute's traffic: a parameter whose every use is the collective or the fusion's result tuple (its
    operand and result buffers, passed through), and the results that are the collective's or a parameter."""
    collectives = collectives_in(instrs)
    root, outputs = _fusion_outputs(instrs)
    passed_through = outputs if instrs[root][1] == "tuple" else []
    params = set()
    for name in parameter_names(instrs).values():
        users = [u for u, i in instrs.items() if name in i[2]]
        if users and all(u in collectives or (u == root and name in passed_through) for u in users):
            params.add(name)
    return params, {o for o in outputs if o in collectives or instrs[o][1] == "parameter"}

