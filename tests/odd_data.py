"""A dataset of a user's own with structured batches: `data._target_=tests.odd_data.<name>` on top
of `data=synthetic`, whose settings it takes."""

from __future__ import annotations

from src.data import Data, Split, synthetic_classification


def halves_and_values(
    seed: int,
    input_dim: int,
    num_classes: int,
    num_samples: int,
    val_fraction: float,
    image_shape: list[int] | None = None,
) -> Data:
    """`data=synthetic`'s samples as dicts: inputs {"left", "right"} (the two halves of the
    features), targets {"label": the class, "value": the features' mean}."""
    data = synthetic_classification(
        seed, input_dim, num_classes, num_samples, val_fraction, image_shape
    )
    return Data(as_dicts(data.train), as_dicts(data.val), data.input_shape, data.num_classes)


def as_dicts(split: Split) -> Split:
    features = split.inputs.flatten(1)
    half = features.shape[1] // 2
    inputs = {"left": features[:, :half], "right": features[:, half:]}
    return Split(inputs, {"label": split.targets, "value": features.mean(1)})
