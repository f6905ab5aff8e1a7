"""`glyd pack SRC DST` and `glyd verify DST [--against SRC]`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("pack", help="pack a bf16 safetensors model directory into a Glyd checkpoint")
    p.add_argument("src", help="model directory, 'demo', or a Hugging Face id")
    p.add_argument("dst", type=Path, help="directory to create")
    p.add_argument("--force", action="store_true", help="replace DST if it is a Glyd checkpoint")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.set_defaults(func=run_pack)
    v = sub.add_parser("verify", help="decode every tensor of a Glyd checkpoint and check it")
    v.add_argument("dir", type=Path)
    v.add_argument("--against", help="the source model: compare every bit")
    v.add_argument("--json", action="store_true", help="print the report as JSON")
    v.add_argument("--quiet", action="store_true", help="totals only")
    v.set_defaults(func=run_verify)


def _resolve(src: str) -> Path:
    from glyd_engine.models import resolve_model
    from glyd_engine.progress import print_progress

    return resolve_model(src, progress=print_progress)


def _print_report(report, as_json: bool, quiet: bool = False, extra: dict | None = None) -> None:  # noqa: ANN001
    summary = {
        "tensors_packed": len(report.tensors),
        "weights_bits_per_value": round(report.bits_per_weight, 4),
        "packed_values": report.packed_values,
        "packed_bytes": report.packed_bytes,
        "plain_bytes": report.plain_bytes,
        "bits_per_weight_overall": round(8 * report.total_bytes / max(1, report.packed_values
                                                                        + report.plain_bytes // 2), 4),
        **(extra or {}),
    }
    if as_json:
        summary["per_tensor"] = {n: round(b, 4) for n, _, b in report.tensors}
        print(json.dumps(summary, indent=2))
        return
    if not quiet:
        for name, shape, bits in report.tensors:
            print(f"{bits:7.3f} bits/weight  {'x'.join(map(str, shape)):>14}  {name}")
    for k, v in summary.items():
        print(f"{k}: {v}")


def run_pack(args: argparse.Namespace) -> int:
    from glyd_engine.format.checkpoint import pack_model
    from glyd_engine.models.known import remember
    from glyd_engine.progress import print_progress

    report = pack_model(_resolve(args.src), args.dst, progress=print_progress, overwrite=args.force)
    remember(Path(args.dst))  # listed by `glyd models list` wherever it was written
    _print_report(report, args.json, quiet=not args.json)
    print(f"wrote {args.dst}", file=sys.stderr)
    return 0


def run_verify(args: argparse.Namespace) -> int:
    from glyd_engine.format.checkpoint import verify_model
    from glyd_engine.progress import print_progress

    against = _resolve(args.against) if args.against else None
    report = verify_model(args.dir, against, progress=print_progress)
    extra: dict = {"tensors_expected": report.expected, "tensors_checked": report.checked,
                   "tensors_compared_bit_for_bit": report.compared, "warnings": report.warnings}
    if against is not None:  # only a comparison with the source shows the bits are the source's
        extra["exact"] = report.exact
    for warning in report.warnings:
        print(f"glyd: warning: {warning}", file=sys.stderr)
    _print_report(report, args.json, args.quiet, extra)
    return 0 if against is None or report.exact else 1
