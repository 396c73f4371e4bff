"""A small, standard PyTorch training loop on random tensors (CPU, a few seconds).

Nothing in it knows about loadopt; measure its input stalls with

    loadopt measure examples/measure_loop.py [--steps 60] [--workers 0] [--load-ms 4]

The dataset spends `--load-ms` per sample "decoding" (a sleep, like I/O or a decoder that releases
the GIL), so with few workers the loop waits for data; with more it does not.
"""

from __future__ import annotations

import argparse
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset


class SlowRandomImages(Dataset):
    """Random 3x32x32 images and labels; each sample costs `load_ms` to "load"."""

    def __init__(self, size: int, load_ms: float) -> None:
        self.size, self.load_s = size, load_ms / 1000.0
        self.generator = torch.Generator().manual_seed(0)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        time.sleep(self.load_s)
        return torch.randn(3, 32, 32), index % 10


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--load-ms", type=float, default=1.0)
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(4), nn.Flatten(),
                          nn.Linear(16 * 16, 10))
    optimiser = torch.optim.SGD(model.parameters(), lr=0.01)
    dataset = SlowRandomImages(args.steps * args.batch_size, args.load_ms)
    loader = DataLoader(dataset, batch_size=args.batch_size, shuffle=True, num_workers=args.workers)
    started = time.perf_counter()
    for step, (images, labels) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(images), labels)
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
        if step % 20 == 0:
            print(f"step {step}: loss {loss.item():.3f}")
    print(f"{args.steps} steps in {time.perf_counter() - started:.2f} s")


if __name__ == "__main__":
    main()
