"""A Hugging Face Trainer guarded by sdc_agent: one line, trainer.add_callback(...).

    python -m torch.distributed.run --nproc-per-node 3 examples/huggingface_trainer.py

A tiny GPT-2 with random weights (built from a config: nothing is downloaded) on random
tokens. Set HYPERPOD_SDC_FAULTS to run a drill, e.g.
HYPERPOD_SDC_FAULTS="rank=1,step=6,site=forward,kind=relative,persistent=true,\
target=transformer.h.0.mlp,index=all".
"""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

from sdc_agent.integrations.huggingface import SDCCallback


def main() -> None:
    train()
    if dist.is_initialized():  # the Trainer started the process group; end it (quickstart.py)
        dist.barrier()
        dist.destroy_process_group()


def train() -> None:
    rank = int(os.environ.get("RANK", "0"))
    # One machine: let each process stand for a node, so the replay audit has partners on
    # "other nodes". On a cluster NODE_NAME comes from the pod spec.
    os.environ.setdefault("NODE_NAME", f"local-node-{rank}")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=64, vocab_size=128))
    g = torch.Generator().manual_seed(1)
    data = [
        {"input_ids": (ids := torch.randint(0, 128, (16,), generator=g)), "labels": ids.clone()}
        for _ in range(256)
    ]
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=12,
            use_cpu=True,
            report_to=[],
            save_strategy="no",
            logging_steps=1000,
            disable_tqdm=True,
        )
        trainer = Trainer(model=model, args=args, train_dataset=data)
        callback = SDCCallback(
            trainer, replay_every=3, weights_every=3, fingerprint_backend="eager"
        )
        trainer.add_callback(callback)  # the one line
        trainer.train()
    if rank == 0:
        for verdict in callback.verdicts:
            print(f"step {verdict.step}: {verdict.message}", flush=True)
        print(
            f"done: {len(callback.results)} steps, {len(callback.verdicts)} verdict(s)", flush=True
        )


if __name__ == "__main__":
    main()
