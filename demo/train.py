"""The main demo job: a GPT-style byte-level language model trained under ZeRO.

Trains ``demo.model.build_gpt`` on the Python standard library's own source text (every
machine has it offline) with :class:`zero_runtime.ZeroInfinityStrategy`, writing the
Memory Hierarchy summaries to ``LOGDIR/RUN``. The model code knows nothing of sharding;
everything ZeRO-related is the strategy wrapped around it here::

    python -m demo.train --logdir logs/demo --steps 300
    tensorboard --logdir logs/demo --samples_per_plugin=memory_hierarchy=0

With ``--checkpoint-dir DIR`` it saves sharded checkpoints (``zero_runtime.checkpoint``)
every ``--checkpoint-every`` steps and after the last; ``--resume`` restores the newest
one first and trains the remaining steps of ``--steps`` on the batches an uninterrupted
run would have seen next (each checkpoint records the sequences seen, so a changed
``--batch-size`` continues at the next unseen sequence). A ``latest`` that names a missing
or damaged checkpoint, or one of another architecture, stops the job with status 2 and
leaves the directory as it was.

Exit status: 0 on success, 1 on out of memory (the post-mortem's path on stderr), 2 on bad
arguments, an invalid config, a damaged, foreign or unwritable checkpoint (a save that
failed, e.g. on a full disk: the message names the file; the published checkpoints stay as
they were) (message on stderr).
"""
# isort: skip_file  (the CPU allocator must be chosen before TensorFlow is imported)

from __future__ import annotations

import os

# The device tier's CPU stand-in is read from TensorFlow's allocator statistics, which
# exist only with the BFC allocator chosen before TensorFlow first loads.
os.environ.setdefault("TF_CPU_ALLOCATOR_USE_BFC", "true")
# A log a person reads: TensorFlow's C++ INFO and WARNING lines (oneDNN notices, data
# pipeline notes, the rendezvous chatter of a failed step) are off unless the user sets
# TF_CPP_MIN_LOG_LEVEL (0 shows everything); errors still print.
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Sequence  # noqa: E402
from pathlib import Path  # noqa: E402

if __package__ in (None, ""):  # run as a script (e.g. by `zero-runtime launch`): find `demo`
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from zero_runtime.cli import positive_int  # noqa: E402  (no TensorFlow import)

DEFAULT_LOGDIR = str(Path(__file__).resolve().parent.parent / "logs" / "demo")


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m demo.train`` (defaults are the embedded demo)."""
    p = argparse.ArgumentParser(
        prog="python -m demo.train",
        description="Train the demo GPT on stdlib source text under ZeroInfinityStrategy.",
    )
    p.add_argument("--logdir", default=DEFAULT_LOGDIR, help="TensorBoard log directory")
    p.add_argument("--run", default="gpt_zero1", help="run name (a subdirectory of logdir)")
    p.add_argument("--steps", type=positive_int, default=300, help="optimizer steps")
    p.add_argument("--batch-size", type=positive_int, default=16, help="global batch size")
    p.add_argument("--seq-len", type=positive_int, default=64, help="tokens per sequence")
    p.add_argument("--d-model", type=positive_int, default=64, help="model width")
    p.add_argument("--layers", type=positive_int, default=2, help="transformer blocks")
    p.add_argument("--replicas", type=positive_int, default=2, help="CPU replicas (no GPU)")
    p.add_argument("--learning-rate", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--corpus-bytes", type=positive_int, default=4 << 20, help="text bytes")
    p.add_argument("--seed", type=int, default=0, help="seed for weights and data order")
    p.add_argument(
        "--config",
        default=None,
        help="a ZeroConfig JSON file, or a DeepSpeed JSON config (has 'zero_optimization')",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override one ZeroConfig key (JSON value), e.g. --set stage=1; repeatable",
    )
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        metavar="DIR",
        help="save sharded checkpoints under DIR (every --checkpoint-every steps and at the end)",
    )
    p.add_argument(
        "--checkpoint-every", type=positive_int, default=100, help="steps between checkpoints"
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="restore the newest checkpoint in --checkpoint-dir, then train the remaining steps",
    )
    p.add_argument(
        "--log-every",
        type=positive_int,
        default=None,
        metavar="N",
        help="print a progress line every N steps (default: about ten lines per run)",
    )
    p.add_argument(
        "--expect-oom",
        action="store_true",
        help="running out of memory is this run's expected outcome: say so, not 'error'",
    )
    p.add_argument(
        "--summary",
        default=None,
        metavar="PATH",
        help="write the run's outcome as JSON to PATH (status, steps, peak, bytes per tier)",
    )
    return p


def load_config(path: str | None, overrides: Sequence[str]):
    """Build the ZeroConfig from an optional file plus ``KEY=VALUE`` overrides.

    Raises:
        zero_runtime.ZeroConfigError: an invalid key or value (the message names it).
        zero_runtime.cli.UsageError: an unreadable or invalid config file.
        ValueError: an override that is not ``KEY=VALUE``.
    """
    from zero_runtime.cli import load_config_file
    from zero_runtime.config import ZeroConfig

    config = load_config_file(path)[0] if path else ZeroConfig()
    changes = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        try:
            changes[key] = json.loads(raw)
        except json.JSONDecodeError:
            changes[key] = raw  # a bare string such as cpu or none
    return config.replace(**changes) if changes else config


def main(argv: Sequence[str] | None = None) -> int:
    """Run the demo; returns the process exit status."""
    args = build_parser().parse_args(argv)
    import zero_runtime
    from zero_runtime.cli import UsageError

    try:
        config = load_config(args.config, args.set)
    except (UsageError, ValueError, TypeError) as exc:  # ZeroConfigError is a ValueError
        print(f"demo.train: error: {exc}", file=sys.stderr)
        return 2

    if args.resume and not args.checkpoint_dir:
        print("demo.train: error: --resume needs --checkpoint-dir", file=sys.stderr)
        return 2
    if args.batch_size % args.replicas:
        print(
            f"demo.train: error: --batch-size {args.batch_size} must be a multiple of "
            f"--replicas {args.replicas} (each replica takes an equal part of the batch)",
            file=sys.stderr,
        )
        return 2
    run_dir = os.path.join(args.logdir, args.run)
    try:
        strategy = zero_runtime.ZeroInfinityStrategy(
            config, logdir=run_dir, num_cpu_replicas=args.replicas
        )
    except NotImplementedError as exc:
        print(f"demo.train: error: {exc}", file=sys.stderr)
        return 2
    # TensorFlow is initialised from here on (the strategy configured the devices first).
    import keras
    import tensorflow as tf

    from demo import data, model

    corpus = data.load_corpus(args.corpus_bytes, seed=args.seed)
    split = data.split_corpus(corpus)
    train = data.make_dataset(split.train, args.seq_len, args.batch_size, seed=args.seed)
    gpt_config = model.GPTConfig(
        seq_len=args.seq_len, d_model=args.d_model, n_layers=args.layers, d_ff=4 * args.d_model
    )
    with strategy.scope():
        gpt = model.build_gpt(gpt_config, seed=args.seed)
        gpt.compile(
            optimizer=keras.optimizers.get(
                {"class_name": "adam", "config": {"learning_rate": args.learning_rate}}
            ),
            loss=model.make_loss(),
        )
    print(
        f"demo.train: {gpt.count_params():,} parameters, ZeRO stage {config.stage}, "
        f"optimizer {type(gpt.optimizer).__module__}.{type(gpt.optimizer).__name__}, "
        f"{strategy.num_replicas_in_sync} replicas on {strategy.device_info.description}",
        flush=True,
    )
    print(f"demo.train: writing Memory Hierarchy summaries to {run_dir}", flush=True)
    from zero_runtime.checkpoint import CheckpointError

    manager, done, samples, callbacks = None, 0, 0, []
    if args.checkpoint_dir:
        try:
            manager, done, samples = _restore(args, gpt, strategy)
        except CheckpointError as exc:  # damaged, foreign or would be overwritten: stop
            strategy.close()
            print(f"demo.train: error: {exc}", file=sys.stderr)
            return 2
        callbacks.append(
            _checkpoint_callback(manager, args.checkpoint_every, done, args.steps, samples, args)
        )
    callbacks.append(_loss_scalars(run_dir, done))
    peaks = DevicePeaks(strategy)
    callbacks.append(peaks.callback())
    remaining = args.steps - done
    if remaining <= 0:
        strategy.close()
        print(f"demo.train: done: the checkpoint is at step {done} >= --steps", flush=True)
        return 0
    every = args.log_every or max(1, remaining // 10)
    callbacks.append(_progress(peaks, done, args.steps, every))
    print(
        "demo.train: tracing and compiling the training step (the first step takes the longest)",
        flush=True,
    )
    start = time.time()
    try:
        history = gpt.fit(
            resume_dataset(split.train, args, samples, train),
            steps_per_epoch=remaining,
            epochs=1,
            shuffle=False,
            verbose=0,
            callbacks=callbacks,
        )
    except (MemoryError, tf.errors.ResourceExhaustedError) as exc:  # out of memory: exit 1
        return _out_of_memory(strategy, exc, peaks, args)
    except CheckpointError as exc:  # a save failed (disk full...): named, exit 2
        strategy.close()
        print(f"demo.train: error: {exc}", file=sys.stderr)
        return 2
    strategy.close()
    losses = history.history["loss"]
    print(
        f"demo.train: done: {remaining} steps in {time.time() - start:.1f} s, "
        f"final loss {losses[-1]:.3f}, {strategy.runtime.steps_recorded} steps recorded",
        flush=True,
    )
    print(f"demo.train: {peaks.line()}", flush=True)
    _write_summary(args, "trained", peaks, strategy, remaining, losses[-1])
    return 0


def _progress(peaks: DevicePeaks, first_step: int, last_step: int, every: int):
    """A Keras callback printing one line every ``every`` steps (and after the last): the
    step, Keras's running mean loss (nats per token), the device's in-step peak of that
    step (MiB, :class:`DevicePeaks`) and the mean seconds per step since the previous
    line."""
    import keras

    clock = {"t": time.time(), "step": first_step}

    def on_train_batch_end(batch, logs=None):
        step = first_step + batch + 1
        if step % every and step != last_step:
            return
        now = time.time()
        per_step = (now - clock["t"]) / max(1, step - clock["step"])
        clock.update(t=now, step=step)
        peak = peaks.by_step.get(step - 1)
        peak_text = "" if peak is None else f", device peak {peak / MIB:.1f} MiB"
        loss = (logs or {}).get("loss")
        loss_text = "" if loss is None else f", loss {float(loss):.3f}"
        print(
            f"demo.train: step {step}/{last_step}{loss_text}{peak_text}, {per_step:.2f} s/step",
            flush=True,
        )

    return keras.callbacks.LambdaCallback(on_train_batch_end=on_train_batch_end)


def _write_summary(args, status: str, peaks: DevicePeaks, strategy, steps: int, loss=None):
    """Write ``--summary`` (when given): ``{"status": "trained" | "out_of_memory",
    "steps": int, "peak_bytes": float | None, "peak_step": int | None, "cap_bytes": int |
    None, "loss": float | None, "tiers": {tier: {"used_bytes", "param_bytes",
    "optimizer_bytes"}}}`` (bytes; the tiers of the last recorded step, summed over this
    process's replicas as the runtime records them)."""
    if not args.summary:
        return
    peaks.collect()
    step = max(peaks.by_step, key=peaks.by_step.get) if peaks.by_step else None
    records = strategy.runtime.recorder.last(1)
    tiers = {}
    if records:
        for name, t in records[-1].tiers.items():
            tiers[name] = {
                k: (None if v != v else float(v))
                for k, v in t.as_dict().items()
                if k in ("used_bytes", "param_bytes", "optimizer_bytes")
            }
    summary = {
        "status": status,
        "steps": steps,
        "peak_bytes": None if step is None else peaks.by_step[step],
        "peak_step": step,
        "cap_bytes": peaks.cap_bytes,
        "loss": None if loss is None else float(loss),
        "tiers": tiers,
    }
    with open(args.summary, "w", encoding="utf-8") as f:
        json.dump(summary, f)


class DevicePeaks:
    """The device's one measure, step by step: TensorFlow's allocator in-step peak
    (``Readings.framework_device_peak_bytes``: ``get_memory_info(...)['peak']``, reset at
    every step boundary by the runtime's collector; bytes, NaN unread), read from the
    runtime's flight recorder after each batch, compared with the allocator's cap
    (``TF_CPU_BFC_MEM_LIMIT_IN_MB``, MiB) when one is set.

    Attributes:
        by_step: step -> peak bytes (float) of every recorded step seen.
    """

    def __init__(self, strategy) -> None:
        self._runtime = strategy.runtime
        self.by_step: dict[int, float] = {}
        raw = os.environ.get("TF_CPU_BFC_MEM_LIMIT_IN_MB", "").strip()
        self.cap_bytes = int(raw) << 20 if raw.isdigit() and int(raw) > 0 else None

    def collect(self, peak_at_failure: float | None = None, step: int | None = None) -> None:
        """Fold in the records the flight recorder holds (and, at an OOM, the failed
        step's reading, which has no record)."""
        for stats in self._runtime.recorder.last():
            peak = stats.readings.framework_device_peak_bytes
            if peak == peak:  # not NaN
                self.by_step[stats.step] = float(peak)
        if peak_at_failure is not None and step is not None and peak_at_failure == peak_at_failure:
            self.by_step[step] = max(self.by_step.get(step, 0.0), float(peak_at_failure))

    def callback(self):
        """A Keras callback collecting after every batch."""
        import keras

        return keras.callbacks.LambdaCallback(
            on_train_batch_end=lambda batch, logs=None: self.collect()
        )

    def line(self, failed: bool = False) -> str:
        """One log line: the highest in-step peak, its step, the cap, and whether any
        step went over it."""
        self.collect()
        if not self.by_step:
            return "device: TensorFlow's allocator in-step peak not read (no allocator statistics)"
        step = max(self.by_step, key=self.by_step.get)
        peak = self.by_step[step]
        text = (
            f"device, by TensorFlow's allocator in-step peak: highest {peak / MIB:.1f} MiB "
            f"at step {step} over {len(self.by_step)} steps"
        )
        if self.cap_bytes is None:
            return text + " (no cap: TF_CPU_BFC_MEM_LIMIT_IN_MB unset)"
        if failed:
            return text + f", cap {self.cap_bytes / MIB:g} MiB: an allocation past it failed"
        over = sum(p > self.cap_bytes for p in self.by_step.values())
        verdict = "within it on every step" if not over else f"over it on {over} steps"
        return text + f", cap {self.cap_bytes / MIB:g} MiB: {verdict}"


MIB = 1 << 20


def _restore(args, gpt, strategy):
    """The job's CheckpointManager (``--checkpoint-dir``, 3 kept), the step it resumes at
    and the training sequences seen before it: the newest checkpoint's with ``--resume``
    (0 and 0 when the directory has no checkpoint at all).

    Raises:
        zero_runtime.checkpoint.CheckpointError: ``--resume`` and ``latest`` names a
            missing or damaged checkpoint, or one of another architecture; or no
            ``--resume`` and the directory already holds checkpoints.
    """
    import numpy as np

    from zero_runtime.checkpoint import CheckpointError, CheckpointManager

    manager = CheckpointManager(args.checkpoint_dir, gpt, strategy, max_to_keep=3)
    if not args.resume:
        existing = manager.checkpoints()
        if existing:  # a fresh run would replace and prune them
            raise CheckpointError(
                f"--checkpoint-dir {args.checkpoint_dir} already holds checkpoints "
                f"{existing}: pass --resume to continue from the newest, or use another "
                "directory (nothing was changed)"
            )
        return manager, 0, 0
    if manager.latest is None:
        print(f"demo.train: no checkpoint in {args.checkpoint_dir}: starting at step 0")
        return manager, 0, 0
    info = manager.restore()
    saved = info.client_state.get("data", {})
    # Checkpoints without the record (older demos) used this run's batch size.
    samples = int(saved.get("samples", info.step * args.batch_size))
    print(
        f"demo.train: resumed from {info.path} at step {info.step} (saved on "
        f"{info.saved_replicas} replicas, restored on {info.replicas}; {samples} sequences "
        "seen)",
        flush=True,
    )
    for key, now in _data_record(args).items():
        if key in saved and saved[key] != now:
            effect = (
                f"continuing at sequence {samples}"
                if key == "batch_size"
                else "the data stream differs from that run's"
            )
            print(
                f"demo.train: note: --{key.replace('_', '-')} is {now}, the checkpoint's run "
                f"used {saved[key]}: {effect}",
                flush=True,
            )
    lr = float(np.asarray(gpt.optimizer.learning_rate))
    if not np.isclose(lr, args.learning_rate, rtol=1e-6):
        print(
            f"demo.train: note: training on with the checkpoint's learning rate {lr:g} "
            f"(--learning-rate {args.learning_rate:g} is not applied on --resume)",
            flush=True,
        )
    return manager, info.step, samples


def resume_dataset(tokens, args, samples: int, train=None):
    """The training stream after ``samples`` sequences: the batches an uninterrupted run
    with ``args.batch_size`` sees next.

    ``demo.data.make_dataset``'s sequence order does not depend on the batch size, so
    when ``samples`` is a multiple of ``args.batch_size`` this is ``train.skip(samples //
    batch_size)`` (the same batches as the uninterrupted run), and otherwise (the batch
    size changed on ``--resume``) the single-sequence stream skipped by ``samples`` and
    re-batched: the next unseen sequence starts the first batch.

    Args:
        tokens: the training split, 1-D uint8 (``demo.data.split_corpus(...).train``).
        args: the parsed command line (``seq_len``, ``batch_size``, ``seed``).
        samples: sequences already trained on, int >= 0.
        train: ``make_dataset(tokens, seq_len, batch_size, seed)`` if already built.

    Returns:
        A ``tf.data.Dataset`` of ``(x, y)`` int32 ``[batch_size, seq_len]`` pairs.
    """
    from demo import data

    if samples % args.batch_size == 0:
        if train is None:
            train = data.make_dataset(tokens, args.seq_len, args.batch_size, seed=args.seed)
        return train.skip(samples // args.batch_size)
    one = data.make_dataset(tokens, args.seq_len, 1, seed=args.seed)  # (1, T) each
    return one.unbatch().skip(samples).batch(args.batch_size, drop_remainder=True)


def _data_record(args) -> dict:
    """What decides the demo's data stream (saved in each checkpoint's client state)."""
    return {
        "batch_size": args.batch_size,
        "seq_len": args.seq_len,
        "seed": args.seed,
        "corpus_bytes": args.corpus_bytes,
    }


def _checkpoint_callback(manager, every: int, first_step: int, last_step: int, samples, args):
    """A Keras callback saving a checkpoint (tag ``step<N>``) after every step N that is a
    multiple of ``every`` and after ``last_step``; batch ``b`` of this fit is step
    ``first_step + b + 1``. Each checkpoint's client state records the training sequences
    seen (``samples`` before this fit plus ``--batch-size`` per step since) and the data
    settings (:func:`_data_record`), so ``--resume`` continues the stream exactly even
    with another ``--batch-size``."""
    import keras

    def on_train_batch_end(batch, logs=None):
        step = first_step + batch + 1
        if step % every == 0 or step == last_step:
            seen = samples + (batch + 1) * args.batch_size
            manager.save(client_state={"data": {**_data_record(args), "samples": seen}})

    return keras.callbacks.LambdaCallback(on_train_batch_end=on_train_batch_end)


def _loss_scalars(run_dir: str, first_step: int):
    """A Keras callback writing each step's training loss (Keras's running mean over the
    epoch, as its progress bar shows it; float32, nats per token) as the standard
    TensorBoard scalar ``train/loss`` into ``run_dir``, at step
    ``first_step + batch``, so the Scalars dashboard (and tbparse) shows the loss beside
    the Memory Hierarchy tab's records of the same run."""
    import keras
    import tensorflow as tf

    writer = tf.summary.create_file_writer(run_dir)

    def on_train_batch_end(batch, logs=None):
        if logs and "loss" in logs:
            with writer.as_default():
                tf.summary.scalar("train/loss", float(logs["loss"]), step=first_step + batch)

    def on_train_end(logs=None):
        writer.close()

    return keras.callbacks.LambdaCallback(
        on_train_batch_end=on_train_batch_end, on_train_end=on_train_end
    )


def _out_of_memory(
    strategy, exc: BaseException, peaks: DevicePeaks | None = None, args=None
) -> int:
    """Report an out-of-memory failure in three lines: the step, the tier, the cause and
    the best verified change (from the post-mortem), the device's allocator in-step peak
    (:class:`DevicePeaks`), then the post-mortem's path, once. With ``--expect-oom`` the
    first line says "expected" instead of "error". Returns exit status 1."""
    path = strategy.write_postmortem(exc)
    strategy.close()
    report = None
    try:  # the post-mortem's own account names the tier, the step and the cause
        with open(path, encoding="utf-8") as f:
            report = json.load(f)
    except (OSError, ValueError, TypeError):
        pass
    expected = args is not None and args.expect_oom
    kind = "expected" if expected else "error"
    print(f"demo.train: {kind}: out of memory: {_oom_line(report, exc)}", file=sys.stderr)
    if peaks is not None:
        readings = (report or {}).get("readings") or {}
        peaks.collect(readings.get("framework_device_peak_bytes"), (report or {}).get("step"))
        print(f"demo.train: {peaks.line(failed=True)}", file=sys.stderr)
        if args is not None:
            failed = (report or {}).get("step")
            _write_summary(args, "out_of_memory", peaks, strategy, failed or 0)
    where = path or "(not written: no run directory)"
    print(
        f"demo.train: OOM post-mortem: {where} (read it with: zero-runtime oom-report "
        f"{os.path.dirname(path) if path else 'RUN_DIR'})",
        file=sys.stderr,
    )
    return 1


def _oom_line(report: dict | None, exc: BaseException) -> str:
    """One line for the log: "Step S ran out of memory on the T tier: CAUSE; best change:
    K=V (fits)"; when TensorFlow's allocator refused a request (its own
    ``ResourceExhaustedError``), that comes first and the cause is named as the runtime's
    accounting. Without a report, the error's first line (the path left out: the next
    line names it)."""
    if not isinstance(report, dict) or "failed_request" not in report:
        text = str(exc).split("\npost-mortem:")[0].strip()
        return text.splitlines()[0] if text else type(exc).__name__
    request = report["failed_request"]
    tier = request.get("tier")
    line = f"Step {report.get('step')} ran out of memory on the {tier} tier"
    allocator = request.get("error_type") == "ResourceExhaustedError"
    if allocator:
        line += f": TensorFlow's allocator refused a request ({report.get('request_text')})"
    if report.get("cause"):
        line += f"{'; by the runtime accounting of model states, ' if allocator else ': '}"
        line += report["cause"]
    best = (report.get("advice") or [None])[0]
    if best and best.get("verdict") in ("fits", "may fit"):
        change = ", ".join(f"{k}={json.dumps(v)}" for k, v in best["change"].items())
        line += f"; best change: {change} ({best['verdict']})"
    return line


if __name__ == "__main__":
    sys.exit(main())
