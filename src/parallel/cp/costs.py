"""The `cp` degree's planner arithmetic (its mechanism: `apply.py`, `ring.py`): each rank's
share of the activations, and what torch's ring sends per step.

A cp rank holds 1/cp of every sequence, so 1/cp of the activations the trace of whole sequences
finds. torch's ring (`_templated_ring_attention`, with its default all-gather rotation) gathers
each attention layer's keys and values from the cp ranks once in the forward pass and again in
the backward (each rank sends its share cp - 1 times), and in the backward passes the key and
value gradients round the ring, one send per ring step (cp)."""

from __future__ import annotations

from collections.abc import Sequence

from src.parallel.shares import Messages


def ring_activations_kept(cp: int) -> float:
    """The share of the traced activations of whole sequences that one cp rank holds."""
    return 1 / cp


def local_key_values(key_values: Sequence[int], samples: int, cp: int, tp: int) -> list[int]:
    """One rank's keys and values of each attention layer per micro-step: `key_values` are each
    layer's per sample of whole sequences (`check_attention`), split over cp along the sequence
    and over tp by heads."""
    return [size * samples // (cp * tp) for size in key_values]


def ring_working_set(
    key_values: Sequence[int], samples: int, cp: int, tp: int, backward: bool = True
) -> dict[str, int]:
    """What the ring adds to a rank's activations while one attention layer runs: its keys and
    values gathered from every cp rank, and in the backward the key and value gradients it
    accumulates and the ones in flight round the ring."""
    local = max(local_key_values(key_values, samples, cp, tp), default=0)
    return {"activations": (cp + 2 * backward) * local}


def ring_traffic(
    key_values: Sequence[int], samples: int, accumulate: int, cp: int, tp: int
) -> dict[str, int]:
    """What each cp rank sends per step: the keys and values gathered twice, the gradients
    passed cp times."""
    local = sum(local_key_values(key_values, samples, cp, tp))
    return {
        "ring key/value all-gather": accumulate * 2 * (cp - 1) * local,
        "ring key/value gradient passes": accumulate * cp * local,
    }


def ring_messages(
    key_values: Sequence[int], samples: int, accumulate: int, cp: int, tp: int
) -> list[Messages]:
    """The ring's messages per step: two all-gathers per attention layer, and cp sends of its
    gradients in the backward, which wait on each ring step's attention."""
    local = local_key_values(key_values, samples, cp, tp)
    if not local:
        return []
    each = sum(local) // len(local)
    return [
        Messages("all_gather", 2 * accumulate * len(local), cp * each, cp),
        Messages("send", cp * accumulate * len(local), each, cp),
    ]
