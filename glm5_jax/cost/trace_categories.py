"""Read a jax.profiler trace (``*.xplane.pb``) against the compile report's categories.

The trace's op events name an HLO instruction and its module (stats ``hlo_op``, ``hlo_module``); the
trace's ``/host:metadata`` plane stores each compiled module as an ``HloProto`` whose instructions carry
the op_name metadata (the `jax.named_scope` / Flax module path) that `glm5_jax.cost.categories.categorize`
files. `time_by_category` joins the two: measured time per category, to set beside the compile report.

The protos are read with a small protobuf wire-format decoder (field numbers from tsl's
``xplane.proto`` and XLA's ``hlo.proto``), so no TensorFlow / XProf install is needed.
"""
from __future__ import annotations

import collections

from glm5_jax.cost.categories import categorize
from glm5_jax.platforms import skip_absent_tpu

# field numbers: XSpace.planes=1; XPlane.name=2, event_metadata=4 (map: key 1, value 2), stat_metadata=5,
# XEventMetadata.name=2, stats=5; XStatMetadata.name=2; XStat.metadata_id=1, bytes_value=6;
# HloProto.hlo_module=1; HloModuleProto.name=1, computations=3; HloComputationProto.instructions=2;
# HloInstructionProto.name=1, metadata=7; OpMetadata.op_name=2
METADATA_PLANE = "/host:metadata"
HLO_PROTO_STATS = ("Hlo Proto", "hlo_proto")     # the stat holding a module's serialized HloProto


def _fields(buf: bytes):
    """(field number, value) of one message: ints for varints / fixed, bytes for length-delimited."""
    i, n = 0, len(buf)
    while i < n:
        key, i = _varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 1:
            value, i = int.from_bytes(buf[i:i + 8], "little"), i + 8
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i:i + size], i + size
        elif wire == 5:
            value, i = int.from_bytes(buf[i:i + 4], "little"), i + 4
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        yield field, value


def _varint(buf: bytes, i: int):
    shift = result = 0
    while True:
        b = buf[i]
        i += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, i
        shift += 7


def _first(buf: bytes, number: int, default=b""):
    return next((v for f, v in _fields(buf) if f == number), default)


def hlo_op_names(xspace: bytes) -> dict[str, dict[str, str]]:
    """{module name: {instruction name: op_name}} from the HLO protos in the trace's metadata plane."""
    modules: dict[str, dict[str, str]] = {}
    for field, plane in _fields(xspace):
        if field != 1 or _first(plane, 2).decode() != METADATA_PLANE:
            continue
        stat_names = {}
        for f, entry in _fields(plane):
            if f == 5:
                stat_names[_first(entry, 1, 0)] = _first(_first(entry, 2), 2).decode()
        for f, entry in _fields(plane):
            if f != 4:
                continue
            for g, stat in _fields(_first(entry, 2)):
                if g == 5 and stat_names.get(_first(stat, 1, 0)) in HLO_PROTO_STATS:
                    module = _first(_first(stat, 6), 1)
                    names = modules.setdefault(_first(module, 1).decode(), {})
                    for h, computation in _fields(module):
                        if h != 3:
                            continue
                        for k, instruction in _fields(computation):
                            if k == 2:
                                names[_first(instruction, 1).decode()] = _first(_first(instruction, 7), 2).decode()
    return modules


def op_events(path: str):
    """(module, instruction, duration ns) of each HLO op the trace timed."""
    from jax.profiler import ProfileData

    for plane in ProfileData.from_file(path).planes:
        for line in plane.lines:
            for event in line.events:
                stats = dict(event.stats)
                if "hlo_op" in stats and "hlo_module" in stats:
                    yield str(stats["hlo_module"]), str(stats["hlo_op"]), float(event.duration_ns)


def time_by_category(path: str, module_prefix: str = "") -> dict[str, float]:
    """Seconds of traced HLO ops per category (modules whose name starts with `module_prefix`)."""
    with open(path, "rb") as f:
        names = hlo_op_names(f.read())
    seconds = collections.Counter()
    for module, op, ns in op_events(path):
        if module.startswith(module_prefix):
            seconds[categorize(names.get(module, {}).get(op, ""))] += ns * 1e-9
    return dict(seconds)


def main(argv: list[str]) -> None:
    """python -m glm5_jax.cost.trace_categories TRACE.xplane.pb [MODULE_PREFIX]: seconds per category."""
    skip_absent_tpu()
    if len(argv) not in (2, 3):
        raise SystemExit(main.__doc__)
    seconds = time_by_category(argv[1], argv[2] if len(argv) == 3 else "")
    total = sum(seconds.values()) or 1.0
    for category, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"{category:16s} {s * 1e3:10.3f} ms  {100 * s / total:5.1f}%")


if __name__ == "__main__":
    import sys

    main(sys.argv)
