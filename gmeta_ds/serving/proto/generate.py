"""Regenerate grpc_predict_v2_pb2.py and grpc_predict_v2_pb2_grpc.py from grpc_predict_v2.proto
(``make proto``, or ``python -m gmeta_ds.serving.proto.generate``; ``--check`` only compares).

The generated modules are checked in, so that neither installing gmeta-ds[serve] nor building
its wheel needs protoc: grpcio-tools (the dev extra, at the version pinned there, since another
version writes other code) is needed only to change the proto, and
tests/unit/test_serving_grpc.py fails when the checked-in files differ from a fresh generation.

One change is made to protoc's output: the messages are registered in a descriptor pool of
their own instead of protobuf's default one. Their names are the protocol's (``inference.*``,
which the service's wire path ``/inference.GRPCInferenceService/...`` needs), and Triton's and
KServe's clients register the same names in the default pool: in one process with
tritonclient.grpc imported, the default pool would refuse ours as duplicate symbols.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]  # the folder holding gmeta_ds/: protoc's include path, so imports are absolute
PROTO = HERE / "grpc_predict_v2.proto"
OUTPUTS = ("grpc_predict_v2_pb2.py", "grpc_predict_v2_pb2_grpc.py")
_DEFAULT_POOL = "_descriptor_pool.Default().AddSerializedFile("
_OWN_POOL = "_descriptor_pool.DescriptorPool().AddSerializedFile("  # our pool: see the module docstring


def generate(out: Path) -> dict[str, str]:
    """protoc's Python modules of the proto, written under ``out`` (as ``gmeta_ds/serving/proto/``
    below it) and returned as {file name: text}."""
    from grpc_tools import protoc

    rel = PROTO.relative_to(ROOT)
    code = protoc.main(["grpc_tools.protoc", f"-I{ROOT}", f"--python_out={out}", f"--grpc_python_out={out}",
                        str(rel)])
    if code != 0:
        raise RuntimeError(f"protoc failed on {rel} (exit {code})")
    texts = {}
    for name in OUTPUTS:
        path = out / rel.parent / name
        text = path.read_text()
        if name.endswith("_pb2.py"):
            if text.count(_DEFAULT_POOL) != 1:
                raise RuntimeError(f"{name}: expected one {_DEFAULT_POOL!r} in protoc's output")
            text = text.replace(_DEFAULT_POOL, _OWN_POOL)
        path.write_text(text)
        texts[name] = text
    return texts


def stale() -> list[str]:
    """The checked-in generated files that differ from a fresh generation (none: up to date)."""
    with tempfile.TemporaryDirectory() as tmp:
        fresh = generate(Path(tmp))
    return [name for name, text in fresh.items()
            if not (HERE / name).is_file() or (HERE / name).read_text() != text]


def command(argv: list[str]) -> int:
    if argv == ["--check"]:
        names = stale()
        print(f"out of date with {PROTO.name}: {', '.join(names)}" if names else "up to date")
        return 1 if names else 0
    if argv:
        print("usage: python -m gmeta_ds.serving.proto.generate [--check]", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in generate(Path(tmp)).items():
            (HERE / name).write_text(text)
    print(f"wrote {', '.join(OUTPUTS)} from {PROTO.name}")
    return 0


if __name__ == "__main__":
    sys.exit(command(sys.argv[1:]))
