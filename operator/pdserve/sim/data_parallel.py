"""Which data-parallel ranks a `vllm serve` process runs, from vLLM's own flags, as vLLM 0.32
works it out (`EngineArgs.create_engine_config`, vllm/engine/arg_utils.py L2357-2495, and
ParallelConfig's checks, vllm/config/parallel.py L541-545 and L999-1003): how many ranks this
node runs (L, data_parallel_size_local) and the global rank of the first (S).

Only vLLM's internal and hybrid load balancing are modelled (pdserve's pools use those);
external LB (`--data-parallel-rank`, `--data-parallel-external-lb`) is not parsed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DataParallelFlags:
    """vLLM's flags (None: not given)."""

    size: int = 1  # --data-parallel-size
    size_local: int | None = None  # --data-parallel-size-local
    start_rank: int | None = None  # --data-parallel-start-rank
    hybrid_lb: bool = False  # --data-parallel-hybrid-lb
    nnodes: int = 1  # --nnodes
    node_rank: int = 0  # --node-rank
    # A DP rank's own world (TP x PP x PCP): --nnodes divides the whole world, not DP alone.
    world_size_within_dp: int = 1


@dataclass(frozen=True)
class LocalRanks:
    size_local: int  # L
    start_rank: int  # S


def local_ranks(flags: DataParallelFlags) -> LocalRanks:
    """L and S for these flags; ValueError with vLLM's reason where vLLM refuses them."""
    if flags.size < 1 or flags.nnodes < 1 or flags.node_rank < 0:
        raise ValueError(
            "--data-parallel-size and --nnodes must be at least 1, --node-rank at least 0"
        )
    size_local = flags.size_local
    inferred_rank = 0
    if flags.nnodes > 1:
        # arg_utils.py L2357-2405: the node's share of the world, in whole DP ranks.
        world = flags.size * flags.world_size_within_dp
        if world % flags.nnodes != 0:
            raise ValueError(
                f"Invalid data-parallel launch options: `--nnodes {flags.nnodes}` must evenly "
                f"divide the total world size ({world}). Adjust `--nnodes`, "
                "`--data-parallel-size`, `--pipeline-parallel-size`, `--tensor-parallel-size`, "
                "or `--prefill-context-parallel-size`."
            )
        if not flags.node_rank < flags.nnodes:
            raise ValueError(
                "Invalid data-parallel launch options: `--node-rank` must be between 0 and "
                f"{flags.nnodes - 1}; got `--node-rank {flags.node_rank}`."
            )
        local_world = world // flags.nnodes
        inferred_rank = flags.node_rank * local_world // flags.world_size_within_dp
        if size_local is None:
            size_local = max(local_world // flags.world_size_within_dp, 1)
    if size_local is None:
        # L2477-2494: one node runs every rank; hybrid LB needs to be told its local ranks.
        if flags.hybrid_lb:
            raise ValueError(
                "Invalid data-parallel launch options: `--data-parallel-hybrid-lb` requires "
                "`--data-parallel-size-local`. Set it to the number of data-parallel ranks on "
                "this node."
            )
        return LocalRanks(flags.size, 0)
    # L2466-2470: an explicit start rank wins, else the one inferred from --node-rank. (Hybrid
    # LB with L = 1 turns into external LB there, which the simulator serves the same way:
    # one rank, S; vLLM 0.32 then fails at start for dense models, docs/design/multinode.md.)
    start = flags.start_rank if flags.start_rank is not None else inferred_rank
    if flags.size == 1:
        start = 0  # parallel.py L1003-1006: without DP the rank is VLLM_DP_RANK (0)
    if size_local < 1:
        raise ValueError("the simulator needs at least one local rank (--data-parallel-size-local)")
    if size_local > flags.size:
        raise ValueError(  # config/parallel.py L541-545
            f"data_parallel_size_local ({size_local}) must be <= data_parallel_size ({flags.size})"
        )
    if not 0 <= start < flags.size:
        raise ValueError(  # config/parallel.py L999-1003
            f"data_parallel_rank ({start}) must be in the range [0, {flags.size})"
        )
    return LocalRanks(size_local, start)
