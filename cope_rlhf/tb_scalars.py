"""The scalars a run logged to TensorBoard, as plain dicts: ``read_scalars(logdir) -> {tag: {step: value}}``.

Reads every event file under ``logdir``, recursively: OpenRLHF's trainer writes one subfolder per launch (a resumed
run adds one); the retired local loop wrote into ``logdir`` itself. ``runs`` limits the read to those
subfolders. Folders are read in sorted order and a later one wins a step that two of them logged. Every scalar is
kept (TensorBoard's reader would otherwise sample 10,000 per tag).
"""

from __future__ import annotations

import glob
import os
from typing import Dict, Optional, Sequence


def event_folders(logdir: str, runs: Optional[Sequence[str]] = None) -> list[str]:
    """The folders under ``logdir`` (or its ``runs`` subfolders) that hold an event file, sorted."""
    roots = [logdir] if runs is None else [os.path.join(logdir, run) for run in runs]
    files = [f for root in roots for f in glob.glob(os.path.join(root, "**", "events.out.tfevents.*"), recursive=True)]
    return sorted({os.path.dirname(f) for f in files})


def read_scalars(logdir: str, runs: Optional[Sequence[str]] = None) -> Dict[str, Dict[int, float]]:
    """{tag: {step: value}} over ``event_folders(logdir, runs)``; {} when there is none."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: Dict[str, Dict[int, float]] = {}
    for folder in event_folders(logdir, runs):
        acc = EventAccumulator(folder, size_guidance={"scalars": 0})
        acc.Reload()
        for tag in acc.Tags()["scalars"]:
            scalars.setdefault(tag, {}).update({e.step: e.value for e in acc.Scalars(tag)})
    return scalars
