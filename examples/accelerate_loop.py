"""A Hugging Face Accelerate training loop whose input comes from `loadopt.make_loader`.

    accelerate launch examples/accelerate_loop.py configs/imagenet.yaml [--backend auto] [--steps 5] [--set ...]
    python examples/accelerate_loop.py configs/imagenet.yaml --cpu      (one process, no launcher)

`accelerator.prepare` wraps DataLoaders; a loadopt loader it hands back as it is: its batches already land on the
device (`LOCAL_RANK`'s under the launcher), each rank reading its own share of every epoch, and
`loader.set_epoch(epoch)` (or `loader.sampler.set_epoch`) starts each epoch as for a DistributedSampler.
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch import nn

from loadopt import make_loader
from loadopt.config import load_config


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5, help="steps per epoch at most")
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    accelerator = Accelerator(cpu=args.cpu)
    config = load_config(args.config, tuple(args.set))
    loader = make_loader(config, backend=args.backend, device=accelerator.device)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                          nn.Linear(8, max(config.dataset.synthetic.num_classes, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    for epoch in range(args.epochs):
        prepared.sampler.set_epoch(epoch)
        for step, (inputs, labels) in enumerate(prepared):
            loss = nn.functional.cross_entropy(model(inputs), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            if step == 0:
                print(f"epoch {epoch}: first labels {labels[:8].tolist()} loss {loss.item():.3f}")
            if step + 1 == args.steps:
                break


if __name__ == "__main__":
    main()
