"""Argument checking shared by the ``hf-superoffload`` commands.

Every number and path is checked by argparse ``type=`` functions, so a bad value ends the command at parse
time with one line naming the flag and exit status 2: no traceback, no partially built model, and no loop that
never yields (``train --batch-size -1`` used to spin forever in the batch packer).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

__all__ = ["OneLineParser", "existing_folder", "float_in", "int_in", "model_spec", "offload_config"]


class OneLineParser(argparse.ArgumentParser):
    """``ArgumentParser`` whose errors are one line (``prog: error: argument --flag: why``), exit status 2.
    Subparsers inherit the class, so every subcommand reports the same way."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def int_in(lo: int, hi: int, hint: str = "") -> Callable[[str], int]:
    """A whole number in ``[lo, hi]``; ``1e6`` is read as 1000000."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            try:
                as_float = float(text)
            except ValueError:
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
            if not (math.isfinite(as_float) and as_float.is_integer()):
                raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
            value = int(as_float)
        if not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{text} is out of range: use {lo}..{hi:,}{hint}")
        return value

    return parse


def float_in(lo: float, hi: float, *, lo_open: bool = False, hint: str = "") -> Callable[[str], float]:
    """A finite number in ``[lo, hi]`` (``(lo, hi]`` with ``lo_open``)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        above = value > lo if lo_open else value >= lo
        if not (math.isfinite(value) and above and value <= hi):
            raise argparse.ArgumentTypeError(f"{text} is out of range: use a number in {'(' if lo_open else '['}{lo:g}, "
                                             f"{hi:g}]{hint}")
        return value

    return parse


def _looks_like_a_path(text: str) -> bool:
    """A hub model id is ``name`` or ``org/name``; anything else that names a file system location is a path."""
    return (text.startswith(("/", ".", "~")) or text.endswith(".json") or text.count("/") > 1
            or (sys.platform == "win32" and ("\\" in text or ":" in text)))


def model_spec(presets: tuple[str, ...]) -> Callable[[str], str]:
    """A preset, an existing local file or folder, or a hub model id; a local path that does not exist is refused
    here (transformers would read it as a malformed hub id and say so)."""

    def parse(text: str) -> str:
        if text in presets:
            return text
        path = Path(text).expanduser()
        if path.exists():
            return str(path)
        if _looks_like_a_path(text) or not text.strip():
            raise argparse.ArgumentTypeError(f"{text!r} does not exist: give a preset ({', '.join(presets)}), a local "
                                             "model folder (or config.json) or a hub model id such as org/name")
        return text

    return parse


def offload_config(text: str) -> str:
    """``SuperOffloadConfig`` options as a JSON object (planner switches under ``"overrides"``), checked now by the
    config's own parser (the text is kept: commands build the config)."""
    from .config import SuperOffloadConfig

    try:
        fields = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e.msg} at character {e.pos}): use e.g. "
                                         "'{\"gpu_resident_buckets\": 0}'") from None
    if not isinstance(fields, dict):
        raise argparse.ArgumentTypeError("expected a JSON object of SuperOffloadConfig fields, e.g. "
                                         "'{\"gpu_resident_buckets\": 0}'")
    try:
        SuperOffloadConfig.from_dict(fields)
    except (TypeError, ValueError) as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def existing_folder(text: str) -> str:
    """A folder that exists (a checkpoint to read)."""
    path = Path(text).expanduser()
    if not path.exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist: give a checkpoint folder such as "
                                         "output_dir/checkpoint-500")
    if not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file: give the checkpoint folder that holds it")
    return str(path)
