"""The quickstart's terminal: a short line per unit of progress of one stage, read from the stage's log as it grows,
while the log itself keeps everything (tqdm bars, Ray's forwarded worker output, library notices).

    python scripts/quickstart_progress.py STAGE LOG --total N [--pid PID] [--eval-every K] [--quiet-s 45]

scripts/quickstart.sh runs one per stage, beside the stage's command (PID), whose output goes to LOG. It prints,
each line starting with "[quickstart] STAGE":

- warmstart: the warm start's own lines ("[warm start] ..."), then per SFT epoch "epoch k/N  loss L", with the
  time the stage has taken and an estimate of the time left (the mean epoch so far, times the epochs left);
- train: per GRPO step "step k/N  rollout success S  held-out H (step j)", elapsed and time left (the mean step so
  far, evals left out, times the steps left, plus the evals left at the last eval's duration, from --eval-every);
  each held-out eval's success; the trainer's own warnings (OpenRLHF's and CoPE's logger lines at WARNING or ERROR;
  library warnings stay in the log);
- any stage: when it printed nothing for --quiet-s seconds, what the stage is busy with (its newest progress bar or
  phase: starting Ray, the vLLM engine, ...), so that the terminal moves at least once a minute.

It ends once PID has exited and LOG is read to its end (without --pid: at the end of LOG). Standard library only:
it starts in a fraction of a second and imports nothing of the trainer.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import sys
import time
from typing import Callable, List, Optional

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
RAY_PREFIX = re.compile(r"^\s*(\([\w.-]+ pid=\d+(?:, ip=[\d.]+)?\)\s*)+")  # "(_CoPEPPOTrainer pid=29262) "
SFT_EPOCH = re.compile(r"\[sft\] epoch (\d+)/(\d+): loss ([0-9.eE+-]+)[^(]*(?:\((\d+) s\))?")
WARM_START = re.compile(r"^\[warm start\] (.*)")
STEP = re.compile(r"Global step (\d+): \{")
ROLLOUT_SUCCESS = re.compile(r"'rollout/success_rate': ([0-9.eE+-]+)")
EVAL = re.compile(r"held-out eval at step (\d+) in (\d+) s: success ([0-9.]+) over (\d+) episodes")
# OpenRLHF's logger format, which CoPE's modules share: "WARNING 12-06 10:55:05 experience_maker.py:74] text"
# (vLLM writes "[file.py:N]" in brackets and Python's warnings module "file.py:N: UserWarning": neither matches)
TRAINER_WARNING = re.compile(r"\b(WARNING|ERROR) \d\d-\d\d \d\d:\d\d:\d\d (\w+\.py:\d+)\] (.*)")
BAR = re.compile(r"([^|:]{1,48}?):\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")  # tqdm: "expert demos:  45%|███ | 135/300"
PHASES = [  # (text in the log, what the stage is doing from then on)
    ("Started a local Ray instance", "Ray is up; starting the model groups"),
    ("Initializing a V1 LLM engine", "starting the vLLM engine"),
    ("Loading weights took", "vLLM engine loaded; first held-out eval"),
    ("Starting experience making", "the policy and reference log-probs of the step's episodes"),
]


def duration(seconds: float) -> str:
    seconds = int(round(max(0.0, seconds)))
    if seconds < 60:
        return f"{seconds} s"
    if seconds < 3600:
        return f"{seconds // 60} min {seconds % 60:02d} s"
    return f"{seconds // 3600} h {seconds % 3600 // 60:02d} min"


class Progress:
    """Turns a stage's log lines into terminal lines. ``feed(line, now)`` for each line (ANSI codes and Ray's
    "(Actor pid=N)" prefixes are stripped here), ``tick(now)`` between lines for the heartbeat; both return the
    lines to print. ``now`` is a clock in seconds (time.monotonic in use, a counter in the tests)."""

    def __init__(self, stage: str, total: int, start: float, quiet_s: float = 45.0, eval_every: int = 0) -> None:
        self.stage, self.total, self.start, self.quiet_s, self.eval_every = stage, total, start, quiet_s, eval_every
        self.last_print = start
        self.activity = "starting"
        self.epoch_seconds: List[float] = []
        self.loop_start: Optional[float] = None  # train: when the first step began (after the first eval)
        self.eval_seconds_in_loop = 0.0
        self.last_eval: Optional[tuple] = None  # (step, success, seconds)
        self.step = 0

    def _say(self, text: str, now: float) -> List[str]:
        self.last_print = now
        return [f"[quickstart] {self.stage}  {text}"]

    def _times(self, now: float, left: Optional[float]) -> str:
        out = f"{duration(now - self.start)} elapsed"
        return out + (f", ~{duration(left)} left" if left is not None else "")

    def _evals_left(self, step: int) -> int:
        if not self.eval_every:
            return 0
        # OpenRLHF evaluates after it logs the step: at step k the eval of step k is still to come
        left = sum(1 for s in range(step, self.total + 1) if s % self.eval_every == 0)
        return left + (1 if self.total % self.eval_every else 0)  # the run's closing eval after the last step

    def feed(self, raw: str, now: float) -> List[str]:
        line = RAY_PREFIX.sub("", ANSI.sub("", raw)).strip()
        if not line:
            return []
        bar = BAR.search(line)
        if bar:
            self.activity = f"{bar.group(1).strip()} {bar.group(2)}/{bar.group(3)}"
        for text, phase in PHASES:
            if text in line:
                self.activity = phase
        match = SFT_EPOCH.search(line)
        if match:
            epoch, epochs, loss = int(match.group(1)), int(match.group(2)), float(match.group(3))
            if match.group(4):
                self.epoch_seconds.append(float(match.group(4)))
            left = (sum(self.epoch_seconds) / len(self.epoch_seconds) * (epochs - epoch)
                    if self.epoch_seconds else None)
            self.activity = f"SFT epoch {min(epoch + 1, epochs)}/{epochs}"
            return self._say(f"epoch {epoch:>2}/{epochs}  loss {loss:.4f}   {self._times(now, left)}", now)
        match = WARM_START.search(line)
        if match:
            return self._say(match.group(1), now)
        match = EVAL.search(line)
        if match:
            step, seconds, success, episodes = int(match.group(1)), int(match.group(2)), match.group(3), match.group(4)
            self.last_eval = (step, success, seconds)
            if step == 0 and self.loop_start is None:
                self.loop_start = now  # the first step starts once the eval before training is done
            elif step > 0:
                self.eval_seconds_in_loop += seconds
            self.activity = f"step {self.step + 1}/{self.total}" if self.step < self.total else "saving the model"
            return self._say(f"held-out success {success} at step {step} ({episodes} episodes, {seconds} s)", now)
        match = STEP.search(line)
        if match:
            self.step = int(match.group(1))
            if self.loop_start is None:
                self.loop_start = self.start
            success = ROLLOUT_SUCCESS.search(line)
            stepping = now - self.loop_start - self.eval_seconds_in_loop
            left = stepping / self.step * (self.total - self.step)
            if self.last_eval:
                left += self._evals_left(self.step) * self.last_eval[2]
            held_out = f"held-out {self.last_eval[1]} (step {self.last_eval[0]})" if self.last_eval else "held-out -"
            rollout = f"rollout success {float(success.group(1)):.3f}" if success else "rollout success -"
            self.activity = f"step {self.step + 1}/{self.total}" if self.step < self.total else "the closing eval"
            return self._say(f"step {self.step:>3}/{self.total}  {rollout}  {held_out}   {self._times(now, left)}",
                             now)
        match = TRAINER_WARNING.search(line)
        if match:
            return self._say(f"{match.group(1).lower()} ({match.group(2)}): {match.group(3)}", now)
        return []

    def tick(self, now: float) -> List[str]:
        if now - self.last_print < self.quiet_s:
            return []
        return self._say(f"busy: {self.activity}   {self._times(now, None)}", now)


def alive(pid: Optional[int]) -> bool:
    """Running: a zombie (exited, not yet reaped by its parent) is not."""
    if pid is None:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: ask the kernel
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def follow(path: str, progress: Progress, pid: Optional[int], emit: Callable[[str], None],
           clock: Callable[[], float] = time.monotonic, poll_s: float = 0.5) -> None:
    """Feeds ``progress`` every line of ``path`` as it is written, until ``pid`` has exited (or, without one, the
    file's end) and the file is read to its end. tqdm ends its updates with a carriage return: those count as
    lines too."""
    pending, handle = "", None
    while True:
        running = alive(pid)  # before reading: what the process wrote before it exited is read below
        if handle is None and os.path.exists(path):
            handle = open(path, encoding="utf-8", errors="replace", newline="")
        chunk = handle.read() if handle else ""
        if chunk:
            pieces = re.split(r"\r\n|\r|\n", pending + chunk)
            pending = pieces.pop()
            for piece in pieces:
                for out in progress.feed(piece, clock()):
                    emit(out)
        elif not running:
            break
        for out in progress.tick(clock()):  # also while the log grows: vLLM's start-up is minutes of lines
            emit(out)
        if running:
            time.sleep(poll_s)
    for out in progress.feed(pending, clock()):
        emit(out)
    if handle:
        handle.close()


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", help="the stage's name, the prefix of every line (warmstart, train)")
    parser.add_argument("log", help="the stage's log file (it may not exist yet)")
    parser.add_argument("--total", type=int, required=True, help="SFT epochs (warmstart) or GRPO steps (train)")
    parser.add_argument("--pid", type=int, help="the stage's process: follow the log until it has exited")
    parser.add_argument("--eval-every", type=int, default=0,
                        help="held-out eval every K steps (train), for the time left (default 0: not counted)")
    parser.add_argument("--quiet-s", type=float, default=45.0,
                        help="say what the stage is busy with after this many seconds without a line (default 45)")
    args = parser.parse_args(argv)
    # quickstart.sh stops this follower with SIGTERM when its stage fails or the user interrupts: end quietly
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    start = time.monotonic()
    progress = Progress(args.stage, args.total, start, args.quiet_s, args.eval_every)
    follow(args.log, progress, args.pid, lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
