"""Argument groups that several ``timeshare`` commands share (issue 33: the parser blocks of
the CLI files repeated one another): each helper adds one option, or one group, with the
same flags, defaults and help wherever it appears. Part of the CLI layer; runs in the
CLI's process.
"""

from __future__ import annotations

import argparse
from pathlib import Path

RESULTS_HELP = "write all results to this file"
ZOO_MODELS_HELP = "zoo models (default: resnet152 inception_v3 bert_base)"
SERVE_MODELS_HELP = "zoo models (default: tiny_mlp tiny_cnn tiny_bert tied_lm)"
BACKGROUND_TRAIN_HELP = "background training MODEL:BATCH (default resnet152:64 on CUDA, tiny_cnn:32 on the CPU)"


def json_option(p: argparse.ArgumentParser, help: str | None = RESULTS_HELP) -> None:
    """``--json PATH``: where the command writes its result."""
    p.add_argument("--json", type=Path, default=None, help=help)


def plot_option(p: argparse.ArgumentParser, help: str | None = None) -> None:
    """``--plot PNG``: where the command draws its result."""
    p.add_argument("--plot", type=Path, default=None, help=help)


def models_option(p: argparse.ArgumentParser, help: str = ZOO_MODELS_HELP) -> None:
    """``--models NAME ...``: the zoo models a benchmark measures."""
    p.add_argument("--models", nargs="+", default=None, help=help)


def device_batch_option(p: argparse.ArgumentParser) -> None:
    """``--batch``, whose default depends on the device (8 on CUDA, 1 on the CPU)."""
    p.add_argument("--batch", type=int, default=None, help="default: 8 on CUDA, 1 on the CPU")


def arena_option(p: argparse.ArgumentParser, example: str = "4GiB") -> None:
    """``--memory``: the arena's size."""
    p.add_argument("--memory", default="auto", help=f"arena size, e.g. {example}")


def background_train_option(p: argparse.ArgumentParser) -> None:
    """``--train MODEL:BATCH``: the training job that runs beside the inferences."""
    p.add_argument("--train", default=None, help=BACKGROUND_TRAIN_HELP)


def device_options(p: argparse.ArgumentParser) -> None:
    """``--dtype`` and ``--device``."""
    p.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "bf16"])
    p.add_argument("--device", default="auto")


def copy_delay_option(p: argparse.ArgumentParser) -> None:
    """``--copy-delay-ms``: the diagnostic that makes a missing wait fail the exactness check."""
    p.add_argument("--copy-delay-ms", type=float, default=0.0,
                   help="diagnostic: hold each group's copy back this long, so that a load that forgot a wait "
                        "surely reads the poisoned block and the exactness check fails (timings are then not "
                        "representative)")


def msec(v: float | None) -> str:
    """A table's cell of milliseconds: one decimal, or "-" where none was measured."""
    return "-" if v is None else f"{v:.1f}"
