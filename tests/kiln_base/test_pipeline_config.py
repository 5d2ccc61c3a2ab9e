"""Pipeline parallelism's config: torchtitan's split of blocks into stages, the schedules' stage and micro-batch
rules, and every mistake as one line naming the key (at parse time, or with the world size and the model's shape:
the launcher's train.check_config before any rank starts)."""

from __future__ import annotations

import pytest

import train
from kiln_base.config import (
    PP_SCHEDULES,
    ModelShape,
    Parallelism,
    check_pipeline,
    check_world,
    parse_args,
    pipeline_plan,
)
from kiln_base.errors import ConfigError

PP = "--parallelism.pipeline_parallel_"
E, N = "tok_embeddings", ("norm", "output")

# Splits computed by torchtitan v0.2.2's own generate_llm_fqn_per_model_part (torchtitan/distributed/
# pipeline_parallel.py), run on these arguments: (stages, blocks, first_less, last_less) -> modules per stage.
TORCHTITAN_SPLITS = [
    ((2, 6, 1, 1), [[E, "layers.0", "layers.1", "layers.2"], ["layers.3", "layers.4", "layers.5", *N]]),
    ((4, 2, 1, 1), [[E], ["layers.0"], ["layers.1"], [*N]]),
    ((4, 6, 1, 1), [[E, "layers.0"], ["layers.1", "layers.2"], ["layers.3", "layers.4"], ["layers.5", *N]]),
    ((3, 7, 0, 2), [[E, "layers.0", "layers.1", "layers.2"], ["layers.3", "layers.4", "layers.5"], ["layers.6", *N]]),
    (
        (4, 8, 2, 0),
        [[E, "layers.0"], ["layers.1", "layers.2", "layers.3"], ["layers.4", "layers.5"], ["layers.6", "layers.7", *N]],
    ),
]


def _plan(local_batch: int = 4, n_layers: int = 6, degree: int = 2, **kw: object) -> tuple[tuple[str, ...], ...]:
    p = Parallelism(pipeline_parallel_degree=degree, **kw)  # type: ignore[arg-type]
    return pipeline_plan(p, local_batch, n_layers).stages


@pytest.mark.parametrize(("args", "expected"), TORCHTITAN_SPLITS, ids=[str(a) for a, _ in TORCHTITAN_SPLITS])
def test_layers_per_stage_split_is_torchtitans(args: tuple[int, int, int, int], expected: list[list[str]]) -> None:
    stages, blocks, first, last = args
    # layers_per_stage = what makes ceil((blocks + first + last) / lps) = stages, as torchtitan counts them; where
    # none does, the default: two stages per rank of a looped schedule
    lps = next((x for x in range(1, 99) if -(-(blocks + first + last) // x) == stages), None)
    kw = {"pipeline_parallel_first_stage_less_layers": first, "pipeline_parallel_last_stage_less_layers": last}
    degree = stages if stages < 4 else 2  # one stage per rank, or two (looped)
    schedule = "1F1B" if degree == stages else "Interleaved1F1B"
    kw |= {"pipeline_parallel_layers_per_stage": lps, "pipeline_parallel_schedule": schedule}
    got = _plan(n_layers=blocks, degree=degree, **kw)
    assert [list(s) for s in got] == expected


def test_default_split_one_stage_per_rank_or_two_and_stage_placement() -> None:
    one = pipeline_plan(Parallelism(pipeline_parallel_degree=2), 4, 6)
    assert (len(one.stages), one.stage_ids(0), one.stage_ids(1)) == (2, (0,), (1,))
    looped = pipeline_plan(Parallelism(pipeline_parallel_degree=2, pipeline_parallel_schedule="Interleaved1F1B"), 4, 6)
    assert (len(looped.stages), looped.stage_ids(0), looped.stage_ids(1)) == (4, (0, 2), (1, 3))
    v = pipeline_plan(Parallelism(pipeline_parallel_degree=2, pipeline_parallel_schedule="ZBVZeroBubble"), 4, 6)
    assert (v.stage_ids(0), v.stage_ids(1)) == ((0, 3), (1, 2))  # V: the first and the last stage on rank 0
    assert v.microbatches == 4


def test_split_points_and_module_lists() -> None:
    assert _plan(pipeline_parallel_split_points=["layers.2"]) == (
        (E, "layers.0", "layers.1"),
        ("layers.2", "layers.3", "layers.4", "layers.5", *N),
    )
    parts = [[E, "layers.0", "layers.1", "layers.2", "layers.3"], ["layers.4", "layers.5", "norm"], ["output"]]
    three = pipeline_plan(Parallelism(pipeline_parallel_degree=3, module_fqns_per_model_part=parts), 3, 6)
    assert [list(s) for s in three.stages] == parts  # norm and output may sit on different stages
    cfg = parse_args(["--parallelism.module_fqns_per_model_part", "tok_embeddings,layers.0;layers.1,norm,output"])
    assert cfg.parallelism.module_fqns_per_model_part == [[E, "layers.0"], ["layers.1", "norm", "output"]]


SPLIT_MISTAKES = [
    ({"pipeline_parallel_layers_per_stage": 3}, 6, "layers_per_stage 3 (ceil((6 blocks + 1 + 1) / 3) = 3 stages): 3"),
    ({"pipeline_parallel_layers_per_stage": 1}, 6, "schedule 1F1B runs exactly 1 stage per rank, but"),
    (
        {"pipeline_parallel_layers_per_stage": 4, "pipeline_parallel_schedule": "Interleaved1F1B"},
        6,
        "schedule Interleaved1F1B runs at least 2 stages per rank",
    ),
    (
        {"pipeline_parallel_layers_per_stage": 1, "pipeline_parallel_schedule": "ZBVZeroBubble"},
        6,
        "schedule ZBVZeroBubble runs exactly 2 stages per rank, but",
    ),
    ({"pipeline_parallel_schedule": "Interleaved1F1B"}, 1, "asks for 4 stages, but the model has 1 blocks"),
    ({"pipeline_parallel_first_stage_less_layers": 8}, 6, "first_stage_less_layers (8) exceeds the 7 blocks"),
    ({"pipeline_parallel_split_points": ["layers.0"]}, 6, "'layers.0' is not a block that can begin a stage"),
    ({"pipeline_parallel_split_points": ["norm"]}, 6, "'norm' is not a block that can begin a stage; name layers.1"),
    ({"pipeline_parallel_split_points": ["layers.3", "layers.2"]}, 6, "name each block once, in increasing order"),
    ({"pipeline_parallel_split_points": ["layers.2", "layers.4"]}, 6, "3 stages do not divide over"),
    (
        {"pipeline_parallel_split_points": ["layers.2"], "pipeline_parallel_layers_per_stage": 2},
        6,
        "split_points and parallelism.pipeline_parallel_layers_per_stage each say how to split the model",
    ),
    ({"module_fqns_per_model_part": [[E, "layers.1"], ["layers.0", *N]]}, 2, "found 'layers.1' where 'layers.0'"),
    (  # a TOML list pasted on the command line: the message shows that syntax
        {"module_fqns_per_model_part": [['[["tok_embeddings"', "layers.0"], ["layers.1", *N]]},
        2,
        "stages by ';', e.g. tok_embeddings,layers.0;layers.1,norm,output",
    ),
    ({"module_fqns_per_model_part": [[E, "layers.0"], []]}, 1, "stage 1 lists no module"),
    ({"pipeline_parallel_microbatch_size": 3}, 6, "local_batch_size (4) must be a multiple of parallelism.pipeline_"),
]


@pytest.mark.parametrize(("kw", "n_layers", "message"), SPLIT_MISTAKES, ids=[m for *_, m in SPLIT_MISTAKES])
def test_split_mistakes_are_one_line(kw: dict, n_layers: int, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        _plan(n_layers=n_layers, **kw)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_microbatch_rules_of_the_schedules() -> None:
    p = Parallelism(pipeline_parallel_degree=4)
    with pytest.raises(ConfigError, match="schedule 1F1B needs at least 4 micro-batches .* = 2 micro-batches"):
        pipeline_plan(p, 2, 8)
    p.pipeline_parallel_schedule = "GPipe"
    assert pipeline_plan(p, 2, 8).microbatches == 2  # GPipe takes fewer micro-batches than stages
    p = Parallelism(pipeline_parallel_degree=2, pipeline_parallel_schedule="Interleaved1F1B")
    rounds = r"// degree 2\) = 2 equal rounds \(torch's rule\): .* 5 micro-batches, which 2 does not divide"
    with pytest.raises(ConfigError, match=rounds):
        pipeline_plan(p, 5, 6)
    assert pipeline_plan(p, 3, 6).microbatches == 3  # one round: fewer than 2 x degree is fine


def test_schedule_table_is_torchs() -> None:
    """PP_SCHEDULES (standard library, for the config checks) against torch's own schedule classes."""
    from torch.distributed.pipelining.schedules import (
        PipelineScheduleMulti,
        PipelineScheduleSingle,
        ScheduleZBVZeroBubble,
        get_schedule_class,
    )

    for name, kind in PP_SCHEDULES.items():
        cls = get_schedule_class(name)
        assert cls.__name__.lower().endswith(name.lower()), (name, cls)
        expected = "single" if issubclass(cls, PipelineScheduleSingle) else "looped"
        expected = "v" if cls is ScheduleZBVZeroBubble else expected
        assert kind == expected and (kind == "single") != issubclass(cls, PipelineScheduleMulti), name


# ----------------------------------------------------------------------------- one line, before any rank

LAUNCHER_MISTAKES = [
    ([f"{PP}degree", "2"], 1, "pipeline_parallel_degree x data_parallel_replicate_degree x tensor_parallel_degree = 2"),
    ([f"{PP}degree", "2", "--parallelism.data_parallel_shard_degree", "2"], 2, "must equal the world size 2"),
    ([f"{PP}degree", "2", f"{PP}layers_per_stage", "3"], 2, "layers_per_stage 3 (ceil((6 blocks + 1 + 1) / 3)"),
    ([f"{PP}degree", "2", f"{PP}schedule", "interleaved1f1b", f"{PP}layers_per_stage", "4"], 2, "at least 2 stages"),
    ([f"{PP}degree", "2", "--model.n_layers", "1", f"{PP}schedule", "ZBVZeroBubble"], 2, "the model has 1 blocks"),
    ([f"{PP}degree", "2", f"{PP}microbatch_size", "3"], 2, "training.local_batch_size (4) must be a multiple of"),
    ([f"{PP}degree", "2", "--model.flavor", "3.2-1B"], 2, "ties its output layer to the embedding table"),
    ([f"{PP}degree", "2", f"{PP}schedule", "ZBVZeroBubble", "--training.compile"], 2, "drop --training.compile"),
    (
        [f"{PP}degree", "2", f"{PP}schedule", "InterleavedZeroBubble", "--activation_checkpoint.selective_ac_option"]
        + ["op"],
        2,
        "which per-op selective activation checkpointing refuses",
    ),
    ([f"{PP}degree", "2", "--profiling.saved_activations_report"], 2, "does not run under pipeline parallelism"),
    (
        [f"{PP}degree", "2", "--float8.enable_float8_linear", "--float8.recipe_name", "mxfp8_rceil", "--float8.emulate"]
        + ["--training.seq_len", "48", "--training.local_batch_size", "4"],
        2,
        "microbatch_size x training.seq_len = 48; make it a multiple of 32",
    ),
    (
        [f"{PP}degree", "2", "--float8.enable_float8_linear", "--float8.recipe_name", "nvfp4", "--float8.emulate"]
        + ["--training.seq_len", "24", "--training.local_batch_size", "4"],
        2,
        "microbatch_size x training.seq_len = 24; make it a multiple of 16",
    ),
    (  # a context-parallel rank's micro-batch holds seq_len / cp tokens of each sequence: 1 x 64 / 4 = 16
        [f"{PP}degree", "2", "--parallelism.context_parallel_degree", "4", "--float8.enable_float8_linear"]
        + ["--float8.recipe_name", "mxfp8_rceil", "--float8.emulate", "--training.seq_len", "64"],
        8,
        "microbatch_size x training.seq_len / context_parallel_degree (4) = 16; make it a multiple of 32",
    ),
    (  # validation runs through the pipeline's schedule too: its batch splits into micro-batches the same way
        [f"{PP}degree", "2", "--validation.enable", "--validation.local_batch_size", "1"],
        2,
        "schedule 1F1B needs at least 2 micro-batches (one per stage); validation.local_batch_size 1",
    ),
    (
        [f"{PP}degree", "2", f"{PP}microbatch_size", "2", "--validation.enable", "--validation.local_batch_size", "3"],
        2,
        "validation.local_batch_size (3) must be a multiple of parallelism.pipeline_parallel_microbatch_size (2)",
    ),
    ([f"{PP}schedule", "DualPipeV"], 2, "DualPipeV overlaps expert-parallel communication (MoE)"),
    ([f"{PP}schedule_csv", "my.csv"], 2, "schedules from a CSV file are not supported"),
]


@pytest.mark.parametrize(("argv", "world", "message"), LAUNCHER_MISTAKES, ids=[m for *_, m in LAUNCHER_MISTAKES])
def test_launcher_refuses_before_ranks_start(
    argv: list[str], world: int, message: str, debug_config: str, capsys: pytest.CaptureFixture
) -> None:
    """train.check_config is what run_train.sh runs before torchrun (tests/e2e/test_pipeline.py runs the launcher
    itself for two of these)."""
    assert train.check_config(["--job.config_file", debug_config, *argv], world_size=world) is None
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("kiln: error: ") and message in line, line


def test_pipeline_keys_are_not_read_without_pipelining(debug_config: str) -> None:
    """torchtitan's debug TOML sets Interleaved1F1B with pipeline_parallel_degree 1: nothing to check or refuse."""
    cfg = train.check_config(
        ["--job.config_file", debug_config, f"{PP}schedule", "Interleaved1F1B", f"{PP}microbatch_size", "3"],
        world_size=1,
    )
    assert cfg is not None and check_pipeline(cfg, ModelShape(256, 6, 16, 16, 768, 2256)) is None


def test_world_with_pipeline_and_every_other_degree() -> None:
    cfg = parse_args(
        [f"{PP}degree", "2", "--parallelism.tensor_parallel_degree", "2", "--parallelism.data_parallel_shard_degree"]
        + ["2", "--training.local_batch_size", "2", "--training.global_batch_size", "8"]
    )
    check_world(cfg, 8)  # pp 2 x dp 2 x tp 2; the data-parallel degree (2) excludes the pipeline's
    with pytest.raises(ConfigError, match=r"pipeline_parallel_degree \(2\) x data_parallel_replicate_degree"):
        check_world(cfg, 4)


def test_v_schedule_on_cpu_needs_a_torch_that_does_not_send_to_its_own_rank() -> None:
    from kiln_base.config import check_pipeline_device

    p = Parallelism(pipeline_parallel_degree=2, pipeline_parallel_schedule="ZBVZeroBubble")
    with pytest.raises(ConfigError, match="ZBVZeroBubble: this torch starts a pipeline by sending between the two"):
        check_pipeline_device(p, "cpu", warmup_sends_to_own_rank=True)
    check_pipeline_device(p, "cpu", warmup_sends_to_own_rank=False)  # torch 2.13
    check_pipeline_device(p, "cuda", warmup_sends_to_own_rank=True)  # not gloo
    p.pipeline_parallel_schedule = "InterleavedZeroBubble"
    check_pipeline_device(p, "cpu", warmup_sends_to_own_rank=True)  # no two stages of one rank are neighbours


def test_memory_check_counts_each_pipeline_ranks_stages() -> None:
    """Under a pipeline each rank holds its stages' training state (and the last stage's rank the logits of one
    micro-batch): a model one rank cannot hold fits over a pipeline, and the refusal names the rank needing most."""
    from kiln_base.config import TRAINING_BYTES_PER_PARAM, check_model_memory, model_params, pipeline_rank_params

    shape = ModelShape(dim=256, n_layers=8, n_heads=16, n_kv_heads=16, ffn_hidden_dim=768, vocab_size=2256)
    plan = pipeline_plan(Parallelism(pipeline_parallel_degree=2), 4, shape.n_layers)
    whole = model_params(shape) * TRAINING_BYTES_PER_PARAM
    ranks = [pipeline_rank_params(shape, plan, r) for r in range(2)]
    assert sum(ranks) == model_params(shape)  # the stages share the model out
    worst = max(ranks) * TRAINING_BYTES_PER_PARAM
    assert worst < whole
    with pytest.raises(ConfigError, match="more than x"):
        check_model_memory(shape, 1, 0, 1, 1, worst, "x")  # one process: the whole model
    check_model_memory(shape, 1, 0, 1, 1, worst, "x", plan)  # one pipeline rank's stages fit
    with pytest.raises(ConfigError, match=r"; pipeline rank \d holds [\d,]+ of them\) needs at least") as e:
        check_model_memory(shape, 1, 0, 1, 1, worst - 1, "x", plan)
    assert "\n" not in str(e.value)
    logits = 32 * shape.vocab_size * 8  # a micro-batch of 32 tokens, on the last stage's rank only
    last = ranks[1] * TRAINING_BYTES_PER_PARAM + logits
    check_model_memory(shape, 1, 32, 1, 1, max(last, ranks[0] * TRAINING_BYTES_PER_PARAM), "x", plan)
    with pytest.raises(ConfigError, match="GiB of logits"):
        check_model_memory(shape, 1, 32, 1, 1, last - 1, "x", plan)
