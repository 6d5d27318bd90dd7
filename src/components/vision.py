"""Image datasets read by torchvision: CIFAR-10/100, MNIST, Fashion-MNIST and an ImageFolder.

The CIFAR and MNIST sets are small enough to hold in memory: torchvision reads their files, and
they become a normalised `Split` (indexed directly, no loader; on a GPU they live there). An
image folder stays on disk and is read, one decoded and normalised image at a time, by
`torchvision.datasets.ImageFolder` through the loop's DataLoader. Each set is checked before any
training: a missing folder or file, an empty class folder, an image that cannot be read, or
images of different sizes fail with one line naming `data.root` (the builders raise
FileNotFoundError or ValueError, which the checks report as a `ConfigError`). Whether the image
size suits the model is the model's check. Imported only through `data=<name>` (`_target_`), so
the rest of the template runs without torchvision.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
from collections.abc import Sequence
from pathlib import Path

import torch
from PIL import Image
from torchvision import datasets
from torchvision.transforms import v2

from src.components.data import carved
from src.components.data_contract import Data, Split

log = logging.getLogger(__name__)

# Per-channel mean and standard deviation of each set's training images (scaled to [0, 1]).
STATS = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "mnist": ((0.1307,), (0.3081,)),
    "fashion_mnist": ((0.2860,), (0.3530,)),
}


def normalise(mean: Sequence[float], std: Sequence[float]) -> v2.Compose:
    """uint8 images (..., channels, height, width) to floats in [0, 1], then standardised."""
    return v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std)])


def without_checksums(cifar: type[datasets.CIFAR10]) -> type[datasets.CIFAR10]:
    """`cifar` (torchvision's CIFAR10 or CIFAR100) checking that its batch files exist instead of
    their md5 sums. torchvision compares every batch with the published file's md5, which any
    other copy (such as the batches the tests write) fails. Its file lists are public class
    attributes, and `check_integrity(path, md5=None)` only checks that the file is there; a
    download (`data.download=true`) still checks the archive's md5."""
    return type(
        cifar.__name__,
        (cifar,),
        {
            "train_list": [[name, None] for name, _ in cifar.train_list],
            "test_list": [[name, None] for name, _ in cifar.test_list],
            "meta": {**cifar.meta, "md5": None},
        },
    )


CIFAR = {
    "cifar10": without_checksums(datasets.CIFAR10),
    "cifar100": without_checksums(datasets.CIFAR100),
}
MNIST = {"mnist": datasets.MNIST, "fashion_mnist": datasets.FashionMNIST}


def expected_files(name: str, root: Path) -> list[Path]:
    """The files torchvision reads for set `name` under `root`."""
    if name in CIFAR:
        cifar = CIFAR[name]
        names = [n for n, _ in cifar.train_list + cifar.test_list] + [cifar.meta["filename"]]
        return [root / cifar.base_folder / n for n in names]
    raw = root / MNIST[name].__name__ / "raw"
    return [raw / Path(url).stem for url, _ in MNIST[name].resources]


def read_set(name: str, root: str, download: bool, train: bool) -> datasets.VisionDataset:
    """torchvision's reader of set `name`, its training or test part, from `root`; a file that is
    not there (and not downloaded) or cannot be read is a one-line error naming data.root."""
    folder = Path(root).expanduser()
    missing = [path for path in expected_files(name, folder) if not path.is_file()]
    if missing and not download:
        raise FileNotFoundError(
            f"data.root={root}: {missing[0].relative_to(folder)} is not there ({len(missing)} of "
            f"data={name}'s files missing); point data.root at the folder that holds "
            f"{missing[0].parent.relative_to(folder)}, or set data.download=true (needs network)"
        )
    reader = CIFAR.get(name) or MNIST[name]
    created = [path for path in (folder, *folder.parents) if not path.exists()]
    try:
        return reader(str(folder), train=train, download=download and bool(missing))
    except (RuntimeError, OSError) as error:  # torchvision's download errors, a failed fetch
        for path in created:  # what a failed download made, deepest first; files stay
            with contextlib.suppress(OSError):
                for inner in sorted(path.rglob("*"), reverse=True):
                    inner.rmdir()
                path.rmdir()
        reason = " ".join(str(error).split())  # torchvision's reasons take several lines
        raise FileNotFoundError(
            f"data.download=true could not fetch data={name} into {root} ({reason}); check the "
            f"network, or put its files into {root}"
        ) from error
    except (pickle.UnpicklingError, EOFError, KeyError, ValueError) as error:
        raise ValueError(
            f"data.root={root}: data={name}'s files cannot be read ({type(error).__name__}: "
            f"{error}); they are not the published format, or were cut short"
        ) from error


def in_memory(name: str, root: str, download: bool, train: bool) -> Split:
    """Set `name`'s training or test part as a normalised (samples, channels, height, width)
    float split with class-id targets."""
    dataset = read_set(name, root, download, train)
    images = torch.as_tensor(dataset.data)
    # CIFAR's are (samples, height, width, channels), MNIST's (samples, height, width).
    images = images.permute(0, 3, 1, 2) if images.dim() == 4 else images.unsqueeze(1)
    targets = torch.as_tensor(dataset.targets, dtype=torch.long)
    return Split(normalise(*STATS[name])(images.contiguous()), targets)


def torchvision_set(
    name: str, num_classes: int, seed: int, root: str, download: bool, val_fraction: float
) -> Data:
    """Set `name`: its published test part tests; `val_fraction` of its training part, chosen from
    the seed, validates, and the rest trains."""
    train, val = carved(in_memory(name, root, download, train=True), val_fraction, seed)
    test = in_memory(name, root, False, train=False)
    return Data(train, val, test, tuple(train.inputs.shape[1:]), num_classes)


def cifar10(seed: int, root: str, download: bool, val_fraction: float) -> Data:
    """CIFAR-10's python batches from `root/cifar-10-batches-py/`."""
    return torchvision_set("cifar10", 10, seed, root, download, val_fraction)


def cifar100(seed: int, root: str, download: bool, val_fraction: float) -> Data:
    """CIFAR-100's python batches from `root/cifar-100-python/`, with its 100 fine labels."""
    return torchvision_set("cifar100", 100, seed, root, download, val_fraction)


def mnist(seed: int, root: str, download: bool, val_fraction: float) -> Data:
    """MNIST's IDX files from `root/MNIST/raw/`."""
    return torchvision_set("mnist", 10, seed, root, download, val_fraction)


def fashion_mnist(seed: int, root: str, download: bool, val_fraction: float) -> Data:
    """Fashion-MNIST's IDX files from `root/FashionMNIST/raw/`."""
    return torchvision_set("fashion_mnist", 10, seed, root, download, val_fraction)


def image_folder(
    seed: int,
    root: str,
    image_size: int | Sequence[int] | None,
    mean: list[float],
    std: list[float],
) -> Data:
    """`root/train/<class>/*` trains, `root/val/<class>/*` validates and `root/test/<class>/*`
    tests (val/ again where there is no test/; said in the log), all with the same classes,
    read by torchvision's ImageFolder as RGB images, resized to `image_size` ([height, width],
    or one int for squares) when given, else all of one size."""
    del seed
    image_size = height_and_width(image_size)
    folder = Path(root).expanduser()
    steps = [v2.ToImage(), *([v2.Resize(image_size)] if image_size else [])]
    transform = v2.Compose([*steps, v2.ToDtype(torch.float32, scale=True), v2.Normalize(mean, std),
                            v2.ToPureTensor()])  # fmt: skip
    train, val = (image_set(folder / part, root, transform) for part in ("train", "val"))
    if (folder / "test").is_dir():
        test = image_set(folder / "test", root, transform)
    else:
        log.warning("data.root=%s has no test/ folder: the test split is val/", root)
        test = val
    for part, other in (("val", val), ("test", test)):
        if train.classes != other.classes:
            raise ValueError(
                f"data.root={root}: train/ has the classes {train.classes} but {part}/ has "
                f"{other.classes}; give them the same class folders"
            )
    distinct = [train, val] + ([test] if test is not val else [])
    sizes = image_sizes([sample for part in distinct for sample in part.samples], root)
    if image_size is None and len(sizes) > 1:
        (first, first_size), (other, other_size) = sorted(sizes.items(), key=lambda s: s[1])[:2]
        raise ValueError(
            f"data.root={root}: {other} is {other_size[1]}x{other_size[0]} but {first} is "
            f"{first_size[1]}x{first_size[0]} (height x width); set data.image_size=[height,width] "
            "to resize every image"
        )
    height, width = image_size or next(iter(sizes.values()))[::-1]
    return Data(train, val, test, (3, height, width), len(train.classes))


def height_and_width(image_size: int | Sequence[int] | None) -> list[int] | None:
    """data.image_size as [height, width]: one int is a square."""
    if image_size is None:
        return None
    size = [image_size] * 2 if isinstance(image_size, int) else list(image_size)
    if len(size) != 2 or not all(isinstance(side, int) and side >= 1 for side in size):
        raise ValueError(
            f"data.image_size must be [height, width] or one size in pixels, got {image_size}"
        )
    return size


def image_set(folder: Path, root: str, transform: v2.Compose) -> datasets.ImageFolder:
    if not folder.is_dir():
        raise FileNotFoundError(
            f"data.root={root}: no folder {folder.name}/ there; data=image_folder reads "
            f"{folder.name}/<class>/<image> under data.root"
        )
    try:
        return datasets.ImageFolder(str(folder), transform=transform)
    except FileNotFoundError as error:  # no class folder, or an empty one
        raise FileNotFoundError(f"data.root={root}: in {folder.name}/, {error}") from None


def image_sizes(samples: list[tuple[str, int]], root: str) -> dict[str, tuple[int, int]]:
    """{path: (width, height)} of the first image of each size, each image's header read (not
    its pixels): an image PIL cannot open stops the run here instead of in a DataLoader worker."""
    sizes: dict[tuple[int, int], str] = {}
    for path, _ in samples:
        try:
            with Image.open(path) as image:
                sizes.setdefault(image.size, path)
        except OSError as error:  # PIL.UnidentifiedImageError is one
            raise ValueError(f"data.root={root}: cannot read the image {path} ({error})") from None
    return {path: size for size, path in sizes.items()}
