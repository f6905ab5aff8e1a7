"""`glyd models pull HF_ID`: say what the model is (size, architecture, whether it fits), then download it.

Refusals (an architecture vLLM cannot run as a text model, a model too large for this machine's memory) come
before any weight is fetched. An interrupted pull resumes where it stopped when run again.
"""

from __future__ import annotations

import argparse
import sys


def add_parser(sub: argparse._SubParsersAction) -> None:
    pull = sub.add_parser("pull", help="download a model from the Hugging Face hub (resumable), after checking "
                                       "that it can run and fits this machine's memory")
    pull.add_argument("model", metavar="HF_ID", help="a Hugging Face model id (org/name)")
    pull.add_argument("--ignore-memory", action="store_true",
                      help="download even if the model looks too large for this machine's free memory")
    pull.set_defaults(func=run_pull)


def run_pull(args: argparse.Namespace) -> int:
    from glyd_engine.models.pull import hub_model_path, plan_pull, pull
    from glyd_engine.progress import print_progress

    plan = plan_pull(args.model)
    print(plan.summary(), file=sys.stderr)
    for note in plan.notes:
        print(f"  note: {note}", file=sys.stderr)
    if hub_model_path(args.model).is_dir():
        print("already downloaded", file=sys.stderr)
    path = pull(plan, progress=print_progress, ignore_memory=args.ignore_memory)
    print(path)
    return 0
