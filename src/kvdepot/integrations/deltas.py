"""The per-request instruction every adapter's scheduler half sends its worker half each step.

Requests carry only *deltas* — chunk keys and block ids the worker has not seen yet — plus this
step's load range and how many chunks are computed, so the metadata an engine broadcasts stays
small (a 128K-token prompt is 512 keys of 16 bytes, sent once). Engines add their own fields.
``planner.DeltaPlanner`` decides them, for every engine's connector.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestDelta:
    """One request's instructions for this step; plain and picklable."""

    request_id: int | str
    new_keys: list[bytes] = field(default_factory=list)  # appended to the worker's chunk keys
    new_block_ids: list[int] = field(default_factory=list)  # appended to the worker's block list
    load_skip_blocks: int = 0  # load blocks [skip, skip + num) of the request ...
    load_num_blocks: int = 0  # ... (0: nothing to load this step)
    save_upto_chunks: int = 0  # the request's first N chunks are computed: save those not saved yet
