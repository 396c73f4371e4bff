"""A Lightning training run whose input comes from `loadopt.make_loader`, through a `LightningDataModule`.

    python examples/lightning_datamodule.py configs/imagenet.yaml [--backend auto] [--epochs 2] [--batches 3]
        [--set key=value ...]

Lightning calls `loader.sampler.set_epoch(epoch)` at the start of every epoch (as it does a DataLoader's), so each
epoch draws its own order and augmentation; a loader's `state_dict` rides in Lightning's checkpoints. Under torchrun
each rank's loader reads its own share (ranks from `torch.distributed`) onto its own device (`LOCAL_RANK`).
Prints each epoch's first labels, so that a run shows the epochs differ.
"""

from __future__ import annotations

import argparse

import lightning
import torch
from torch import nn

from loadopt import make_loader
from loadopt.config import load_config


class LoadoptData(lightning.LightningDataModule):
    """The config's train split through loadopt's chosen backend."""

    def __init__(self, config_path: str, backend: str = "auto", overrides: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.config = load_config(config_path, overrides)
        self.backend = backend

    def train_dataloader(self):
        return make_loader(self.config, backend=self.backend)


class Classifier(lightning.LightningModule):
    def __init__(self, classes: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Conv2d(3, 8, 3, stride=4), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                 nn.Linear(8, classes))
        self.first_labels: dict[int, list[int]] = {}

    def training_step(self, batch, index):
        inputs, labels = batch
        self.first_labels.setdefault(self.current_epoch, labels[:8].tolist())
        return nn.functional.cross_entropy(self.net(inputs), labels)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config")
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batches", type=int, default=3, help="batches per epoch (Lightning's limit_train_batches)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    data = LoadoptData(args.config, args.backend, tuple(args.set))
    model = Classifier(max(data.config.dataset.synthetic.num_classes, 2))
    trainer = lightning.Trainer(max_epochs=args.epochs, limit_train_batches=args.batches, accelerator="auto",
                                logger=False, enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False)
    trainer.fit(model, datamodule=data)
    for epoch, labels in model.first_labels.items():
        print(f"epoch {epoch}: first labels {labels}")


if __name__ == "__main__":
    main()
