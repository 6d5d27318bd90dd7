"""Tiny image sets in their real on-disk formats, written by the tests (nothing is downloaded):
CIFAR's python pickle batches, MNIST's IDX files and an ImageFolder tree of PNGs. Each image is
its class's pattern plus noise, so that a few steps learn something."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np

CIFAR = {  # data= option: (folder, training files, test files, meta file, label key, classes)
    "cifar10": (
        "cifar-10-batches-py",
        [f"data_batch_{i}" for i in range(1, 6)],
        ["test_batch"],
        ("batches.meta", "label_names"),
        "labels",
        10,
    ),
    "cifar100": (
        "cifar-100-python",
        ["train"],
        ["test"],
        ("meta", "fine_label_names"),
        "fine_labels",
        100,
    ),
}


def class_images(
    count: int, classes: int, shape: tuple[int, ...], seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """`count` uint8 images shaped `shape`, labelled 0..classes-1 in turn: a per-class pattern
    plus noise."""
    rng = np.random.default_rng(seed)
    patterns = np.random.default_rng(1234).integers(0, 256, (classes, *shape))
    labels = np.arange(count) % classes
    noise = rng.integers(-40, 40, (count, *shape))
    return np.clip(patterns[labels] + noise, 0, 255).astype(np.uint8), labels


def write_cifar(root: Path, name: str = "cifar10", per_file: int = 40, test: int = 40) -> Path:
    """`root/<folder>/` with CIFAR's pickled batches: {'data': (n, 3072) uint8 rows, channel
    planes of 32x32, 'labels' (or 'fine_labels')}, and its meta file."""
    folder, train_files, test_files, (meta_file, meta_key), label_key, classes = CIFAR[name]
    (root / folder).mkdir(parents=True, exist_ok=True)
    for seed, file in enumerate(train_files + test_files):
        count = per_file if file in train_files else test
        images, labels = class_images(count, classes, (3, 32, 32), seed)
        batch = {"data": images.reshape(count, -1), label_key: labels.tolist()}
        (root / folder / file).write_bytes(pickle.dumps(batch))
    meta = {meta_key: [f"class{i}" for i in range(classes)]}
    (root / folder / meta_file).write_bytes(pickle.dumps(meta))
    return root


def write_idx(path: Path, array: np.ndarray) -> None:
    """`array` (uint8) in the IDX format MNIST ships in (uncompressed, as torchvision reads it)."""
    header = struct.pack(">HBB", 0, 0x08, array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.tobytes())


def write_mnist(root: Path, folder: str = "MNIST", train: int = 120, test: int = 40) -> Path:
    """`root/<folder>/raw/` with MNIST's four IDX files (Fashion-MNIST: folder FashionMNIST)."""
    raw = root / folder / "raw"
    raw.mkdir(parents=True)
    for seed, (part, count) in enumerate((("train", train), ("t10k", test))):
        images, labels = class_images(count, 10, (28, 28), seed)
        write_idx(raw / f"{part}-images-idx3-ubyte", images)
        write_idx(raw / f"{part}-labels-idx1-ubyte", labels.astype(np.uint8))
    return root


def write_image_folder(
    root: Path, classes: int = 3, train: int = 24, val: int = 9, size: int = 16, test: int = 0
) -> Path:
    """`root/{train,val}/class<i>/<n>.png` (and `test/`, with `test` images): RGB PNGs of
    size x size."""
    from PIL import Image

    parts = (("train", train), ("val", val), ("test", test))
    for seed, (part, count) in enumerate(part for part in parts if part[1]):
        images, labels = class_images(count, classes, (size, size, 3), seed)
        for index, (image, label) in enumerate(zip(images, labels, strict=True)):
            folder = root / part / f"class{label}"
            folder.mkdir(parents=True, exist_ok=True)
            Image.fromarray(image).save(folder / f"{index}.png")
    return root
