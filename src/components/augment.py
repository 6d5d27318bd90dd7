"""`data.augment=true`: torchvision's random crop and flip, drawn from (seed, epoch, index).

Imported only when a run augments, so that the rest of the template runs without torchvision.
"""

from __future__ import annotations

import functools

import torch
from torchvision.transforms import v2

from src.components.batches import Tree


@functools.cache
def crop_and_flip(height: int, width: int) -> v2.Compose:
    """A random crop of the image padded (with zeros) by an eighth of its size on each side, then
    a horizontal flip half of the time: CIFAR's standard augmentation."""
    pad = max(1, min(height, width) // 8)
    return v2.Compose([v2.RandomCrop((height, width), padding=pad), v2.RandomHorizontalFlip()])


def augment_image(
    seed: int, sample: tuple[Tree, Tree], epoch: int, index: int
) -> tuple[Tree, Tree]:
    """`sample`'s image cropped and flipped by torchvision's transforms, with their random draws
    taken from (seed, epoch, index) alone: the same sample gets the same augmentation whichever
    process, worker or strategy reads it. torchvision draws from torch's default CPU generator,
    which is seeded for the sample and then set back: the process's own draws go on where they
    were. (`torch.manual_seed` would also seed every other device type, 1000 times slower.)"""
    image, target = sample
    generator = torch.default_generator  # what torchvision draws from; set back afterwards
    state = generator.get_state()
    # A tuple of ints hashes alike in every process (PYTHONHASHSEED salts only str and bytes).
    generator.manual_seed(hash((seed, epoch, index)) & (2**63 - 1))
    try:
        return crop_and_flip(*image.shape[-2:])(image), target
    finally:
        generator.set_state(state)
