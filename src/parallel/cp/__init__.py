"""Context parallel (`parallel.cp`), all of it: how each sequence is split over the cp ranks
and what that costs.

- `ring.py`: torch's ring attention over the cp ranks (`ring_attention`), SDPA's CPU kernel
  given a handler in it, and the check that this torch has the ring's parts;
- `apply.py`: the sequence cut of a batch and of the model's positions (`shard_sequence`), the
  forward pass and its loss on a rank's share (`apply_cp`), and cp's refusals of a model
  (`check_attention`);
- `costs.py`: a cp rank's share of the activations, and its ring's traffic and messages, for the
  planner.
"""
