"""A standard PyTorch training loop whose input comes from `loadopt.make_loader` (CPU, synthetic data).

    python examples/train_classifier.py configs/imagenet.yaml [--backend auto] [--epochs 2]
        [--max-steps N --checkpoint ckpt.pt] [--resume ckpt.pt] [--labels-out labels.json] [--set key=value ...]

`--backend auto` takes the loader the last `loadopt bench` decided on for this dataset and machine (or
the fixed fallback order; the log says which and why). `--backend dataloader` reads as most scripts do: torchvision's
ImageFolder with its reference transform and a plain DataLoader (`loadopt measure` then ends with that pipeline on
loadopt's paths). `--max-steps N` stops after N steps, as a
preempted job would, saving a checkpoint with the model, the optimiser and `loader.state_dict()`;
`--resume` continues from it mid-epoch: no sample is repeated or skipped, whatever the backend.
`--labels-out` writes the label sequence the loop saw (the tests compare it across backends and resumes).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch
from torch import nn

from loadopt import make_loader
from loadopt.config import load_config


class SmallCNN(nn.Module):
    def __init__(self, num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1))
        self.classifier = nn.Linear(32, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x).flatten(1))


def train(config_path: str, backend: str = "auto", epochs: int = 2, max_steps: int | None = None,
          checkpoint: str | None = None, resume: str | None = None, overrides: list[str] | None = None,
          **loader_overrides) -> list[list[int]]:
    """Train; returns the labels of every batch seen, in order."""
    torch.manual_seed(0)
    config = load_config(config_path, overrides or [])
    if backend == "dataloader":  # what most scripts do: a torchvision ImageFolder and a plain DataLoader
        loader = plain_dataloader(config, **loader_overrides)
    else:
        loader = make_loader(config, backend=backend, device="cpu", **loader_overrides)
    model = SmallCNN(len(loader.dataset.classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = 0
    if resume:
        state = torch.load(resume, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        loader.load_state_dict(state["loader"])  # the next batch is the first one not yet trained on
        step = state["step"]
    seen: list[list[int]] = []
    started = time.perf_counter()
    try:
        for epoch in range(getattr(loader, "epoch", 0), epochs):  # resumed: starts in the epoch under way
            if hasattr(loader, "set_epoch"):
                loader.set_epoch(epoch)  # a no-op for the epoch under way, so a resume continues mid-epoch
            for images, labels in loader:
                if images.dtype == torch.uint8:  # pipeline.dtype: uint8 leaves the normalisation to the model
                    images = images.float().div_(255.0)
                loss = nn.functional.cross_entropy(model(images), labels)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                seen.append(labels.tolist())
                step += 1
                if step % 20 == 0:
                    print(f"epoch {epoch} step {step}: loss {loss.item():.3f}", flush=True)
                if max_steps is not None and step >= max_steps:
                    if checkpoint:
                        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                                    "loader": loader.state_dict(), "step": step}, checkpoint)
                        print(f"stopped at step {step} (epoch {epoch}); checkpoint: {checkpoint}", flush=True)
                    return seen
    finally:
        _print_loop_rate(seen, time.perf_counter() - started)
        if hasattr(loader, "close"):
            loader.close()
    return seen


def plain_dataloader(config, num_workers: int = 2) -> torch.utils.data.DataLoader:
    """The config's train split as most training scripts read it: torchvision's ImageFolder with the reference
    script's transform (RandomResizedCrop, flip, ToTensor, Normalize) and a DataLoader (`--backend dataloader`)."""
    from torchvision_style import ImageFolder, classification_train

    from loadopt.storage.open import open_dataset

    root = open_dataset(config).root  # the split's class folders (the synthetic set made on first use)
    dataset = ImageFolder(root, transform=classification_train(config.pipeline.image_size))
    return torch.utils.data.DataLoader(dataset, batch_size=config.pipeline.batch_size, shuffle=True,
                                       num_workers=num_workers)


def _print_loop_rate(seen: list[list[int]], elapsed_s: float) -> None:
    """The loop's own count and clock (building the loader excluded), to hold `loadopt measure` to."""
    samples = sum(map(len, seen))
    rate = samples / elapsed_s if elapsed_s > 0 else 0.0
    print(f"the loop: {len(seen)} steps, {samples} samples in {elapsed_s:.3f} s ({rate:.1f} samples/s)", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--max-steps", type=int, default=None)
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--labels-out", default=None)
    parser.add_argument("--set", dest="overrides", action="append", default=[])
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    seen = train(args.config, args.backend, args.epochs, args.max_steps, args.checkpoint, args.resume,
                 args.overrides)
    print(f"{len(seen)} steps, {sum(map(len, seen))} samples", flush=True)
    if args.labels_out:
        with open(args.labels_out, "w") as handle:
            json.dump(seen, handle)
    return 0


if __name__ == "__main__":
    sys.exit(main())
