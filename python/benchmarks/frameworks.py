"""Each framework's own checkpointing against ckpt's integration, in one run, on the
same model and machine: Lightning, the Hugging Face Trainer, torchtitan's manager.

    python python/benchmarks/frameworks.py [--params-m 25] [--saves 3] [--json]

One process per measurement (world of one, gloo, CPU), each the framework's real
save and resume path:

- ``stall``: how long the training loop is blocked by one save (the framework's
  save call), median of ``--saves``;
- ``durable``: from the start of a save until the checkpoint is whole on its
  store (a synchronous save: when it returns; ckpt: its commit), median;
- ``load``: a resume of the newest checkpoint into a fresh model and optimizer,
  through the framework's own resume path (the strategy's load for Lightning,
  the Trainer's model/optimizer/RNG loading, torchtitan's ``load``).

Defaults: Lightning's ``DDPStrategy`` (``torch.save`` of the whole checkpoint to local
disk), the ``Trainer``'s checkpoint folder on local disk, torchtitan's DCP manager
(``async_mode="async"``, its overlapped mode without pinned memory) on local disk.
ckpt: the integration to a ``file://`` root on the same disk and, when scripts/test's
S3 server is up (``CKPT_TEST_S3_ENDPOINT``), to it. Reads are from the page cache on
both sides (nothing evicts the files between save and load).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

FRAMEWORKS = ("lightning", "transformers", "torchtitan")


# -- one measurement, in a fresh process ---------------------------------------------


def _group() -> None:
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _mlp(params_m: float):
    import torch
    from torch import nn

    width = int((params_m * 1e6 / 4) ** 0.5)
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(width, width) for _ in range(4)])


def _lightning(target: str, saves: int, params_m: float) -> dict:
    import lightning.pytorch as L
    import torch
    from lightning.pytorch.strategies import DDPStrategy
    from torch.utils.data import DataLoader, TensorDataset

    from ckpt.integrations.lightning import CkptDDPStrategy

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp(params_m)

        def training_step(self, batch, _):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    width = _mlp(params_m)[0].in_features
    data = DataLoader(TensorDataset(torch.randn(64, width)), batch_size=4)
    folder = tempfile.mkdtemp(prefix="bench-lightning-")
    stalls, durables = [], []

    class Saver(L.Callback):
        def on_train_batch_end(self, trainer, module, outputs, batch, index):
            path = os.path.join(folder, f"step{trainer.global_step}.ckpt")
            start = time.perf_counter()
            trainer.save_checkpoint(path)
            stalls.append(time.perf_counter() - start)
            pending = getattr(trainer.strategy, "_pending", None)
            if pending is not None:
                pending.wait_committed()
            durables.append(time.perf_counter() - start)

    def strategy():
        return DDPStrategy() if target == "default" else CkptDDPStrategy(target)

    common = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    trainer = L.Trainer(strategy=strategy(), max_steps=saves, callbacks=[Saver()], **common)
    trainer.fit(Model(), data)
    resume = os.path.join(folder, f"step{saves}.ckpt") if target == "default" else target
    fresh = L.Trainer(strategy=strategy(), max_steps=saves, **common)
    timed = {"load": 0.0}
    for name in ("load_checkpoint", "load_model_state_dict", "load_optimizer_state_dict"):
        original = getattr(fresh.strategy, name)

        def clocked(*args, _original=original, **kwargs):
            start = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                timed["load"] += time.perf_counter() - start

        setattr(fresh.strategy, name, clocked)
    fresh.fit(Model(), data, ckpt_path=resume)
    return {"stall": stalls, "durable": durables, "load": timed["load"]}


def _transformers(target: str, saves: int, params_m: float) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments

    from ckpt.integrations.transformers import CkptTrainer

    hidden = int((params_m * 1e6 / 26) ** 0.5) // 8 * 8
    config = LlamaConfig(
        vocab_size=512,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    ids = torch.randint(0, 512, (64, 16), generator=torch.Generator().manual_seed(0))
    data = [{"input_ids": x, "labels": x} for x in ids]
    folder = tempfile.mkdtemp(prefix="bench-hf-")
    stalls, durables, timed = [], [], {"load": 0.0}
    base = Trainer if target == "default" else CkptTrainer

    class Timed(base):
        def _save_checkpoint(self, model, trial):
            start = time.perf_counter()
            super()._save_checkpoint(model, trial)
            stalls.append(time.perf_counter() - start)
            pending = getattr(self, "_ckpt_pending", None)
            if pending is not None:
                pending.wait_committed()
            durables.append(time.perf_counter() - start)

        def _clock(self, method, *args):
            start = time.perf_counter()
            try:
                return method(*args)
            finally:
                timed["load"] += time.perf_counter() - start

        def _load_from_checkpoint(self, *args, **kwargs):
            return self._clock(super()._load_from_checkpoint, *args)

        def _load_optimizer_and_scheduler(self, checkpoint):
            return self._clock(super()._load_optimizer_and_scheduler, checkpoint)

        def _load_rng_state(self, checkpoint):
            return self._clock(super()._load_rng_state, checkpoint)

    def trainer():
        torch.manual_seed(0)
        args = TrainingArguments(
            output_dir=folder,
            use_cpu=True,
            per_device_train_batch_size=4,
            max_steps=saves,
            save_strategy="steps",
            save_steps=1,
            report_to="none",
            disable_tqdm=True,
            learning_rate=1e-4,
        )
        extra = {} if target == "default" else {"ckpt_url": target}
        return Timed(
            model=AutoModelForCausalLM.from_config(config), args=args, train_dataset=data, **extra
        )

    trainer().train()
    trainer().train(resume_from_checkpoint=True)
    return {"stall": stalls, "durable": durables, "load": timed["load"]}


def _torchtitan(target: str, saves: int, params_m: float) -> dict:
    import torch
    from torchtitan.components.checkpointer import CheckpointManager
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer
    from torchtitan.components.optimizer.optimizer import ParamGroupConfig

    from ckpt.integrations.torchtitan import CkptCheckpointManager

    _group()
    folder = tempfile.mkdtemp(prefix="bench-titan-")

    def build():
        model = _mlp(params_m)
        optimizers = OptimizersContainer.Config(
            implementation="for-loop",
            param_groups=[
                ParamGroupConfig(
                    pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 1e-4}
                )
            ],
        ).build(model_parts=[model])
        schedulers = LRSchedulersContainer.Config(warmup_steps=1).build(
            optimizers=optimizers, training_steps=100
        )
        policy = dict(
            enable=True,
            interval=1,
            keep_latest_k=0,
            last_save_model_only=False,
            initial_load_model_only=False,
        )
        if target == "default":
            config = CheckpointManager.Config(folder="ckpt", async_mode="async", **policy)
        else:
            config = CkptCheckpointManager.Config(url=target, **policy)
        manager = config.build(
            dataloader=None,
            model_parts=[model],
            optimizers=optimizers,
            lr_schedulers=schedulers,
            states={},
            sd_adapter=None,
            base_folder=folder,
        )
        return model, optimizers, manager

    model, optimizers, manager = build()
    width = model[0].in_features
    stalls, durables = [], []
    for step in range(1, saves + 1):
        model(torch.randn(4, width)).pow(2).mean().backward()
        manager.maybe_wait_for_staging()
        optimizers.step()
        optimizers.zero_grad()
        start = time.perf_counter()
        manager.save(step)
        manager.maybe_wait_for_staging()  # the loop waits for staging before its step
        stalls.append(time.perf_counter() - start)
        manager.maybe_wait_for_saving()
        durables.append(time.perf_counter() - start)
    manager.close()
    _, _, fresh = build()
    start = time.perf_counter()
    assert fresh.load(step=-1)
    load = time.perf_counter() - start
    fresh.close()
    return {"stall": stalls, "durable": durables, "load": load}


def measure(framework: str, target: str, saves: int, params_m: float) -> dict:
    run = {"lightning": _lightning, "transformers": _transformers, "torchtitan": _torchtitan}
    return run[framework](target, saves, params_m)


# -- the run -------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--params-m", type=float, default=25.0, help="model size, millions")
    p.add_argument("--saves", type=int, default=3)
    p.add_argument("--frameworks", default=",".join(FRAMEWORKS))
    p.add_argument("--json", action="store_true")
    p.add_argument("--one", nargs=2, metavar=("FRAMEWORK", "TARGET"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one:
        result = measure(args.one[0], args.one[1], args.saves, args.params_m)
        print("RESULT " + json.dumps(result), flush=True)
        return

    work = Path(tempfile.mkdtemp(prefix="bench-frameworks-"))
    targets = [("default (local disk)", "default"), ("ckpt file://", f"file://{work}/ckpt")]
    if os.environ.get("CKPT_TEST_S3_ENDPOINT"):
        bucket = os.environ.get("CKPT_TEST_S3_BUCKET", "ckpt-test")
        targets.append(("ckpt s3:// (loopback)", f"s3://{bucket}/bench-{uuid.uuid4().hex}"))
        os.environ.update(
            AWS_ENDPOINT=os.environ["CKPT_TEST_S3_ENDPOINT"],
            AWS_ALLOW_HTTP="true",
            AWS_REGION="us-east-1",
            AWS_ACCESS_KEY_ID="test",
            AWS_SECRET_ACCESS_KEY="test",
        )
    rows = []
    for framework in args.frameworks.split(","):
        for label, target in targets:
            if target.startswith("file://") or target.startswith("s3://"):
                target = f"{target}/{framework}"
            out = subprocess.run(
                [
                    sys.executable,
                    __file__,
                    "--one",
                    framework,
                    target,
                    "--saves",
                    str(args.saves),
                    "--params-m",
                    str(args.params_m),
                ],
                capture_output=True,
                text=True,
                env=dict(os.environ, OMP_NUM_THREADS="2"),
            )
            line = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
            if out.returncode != 0 or not line:
                raise SystemExit(
                    f"{framework} {label} failed:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
                )
            r = json.loads(line[0][len("RESULT ") :])
            rows.append(
                {
                    "framework": framework,
                    "target": label,
                    "stall_s": statistics.median(r["stall"]),
                    "durable_s": statistics.median(r["durable"]),
                    "load_s": r["load"],
                }
            )
            print(
                f"{framework:12} {label:22} stall {rows[-1]['stall_s']:7.3f} s  durable "
                f"{rows[-1]['durable_s']:7.3f} s  load {rows[-1]['load_s']:7.3f} s",
                flush=True,
            )
    if args.json:
        print(json.dumps({"params_m": args.params_m, "saves": args.saves, "rows": rows}))


if __name__ == "__main__":
    main()
