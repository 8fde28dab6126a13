"""The arguments of ``autopar profile``, without torch (``autopar --help`` builds every subcommand's parser)."""

from __future__ import annotations

import argparse

__all__ = ["build_parser"]


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Arguments of ``autopar profile`` (adds to ``parser`` if given, e.g. a CLI subparser)."""
    p = parser or argparse.ArgumentParser(prog="autopar profile", description="Measure this machine's profile.")
    p.add_argument("-o", "--output", required=True, help="profile YAML to write")
    p.add_argument("--ranks", type=int, default=None, help="local ranks (default: #GPUs, or 2 on CPU)")
    p.add_argument("--quick", action="store_true", help="fewer sizes and repeats")
    p.add_argument("--backend", choices=("gloo", "nccl"), default=None, help="default: nccl on CUDA, else gloo")
    p.add_argument("--name", default=None, help="profile name")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    return p
