"""Bad input fails fast: exit code 2, one message that names the setting (and what to change), no
traceback, and nothing written that a run would leave.

HYDRA rows are refused while Hydra composes the config (schema, unknown option, override syntax);
`train.py` prints them as one `train.py: error: ...` line. CHECK rows are refused by
`check_config` (a `ConfigError`), before any process, model or tracker is started; `train.py` logs
them as one `[ERROR]` line. Every row is checked in this process through Hydra's compose API (what
`train.py` composes); one row of each kind also goes through the real `train.py`, which pins how
the message reaches the user.
"""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
from helpers import TINY, needs_gpus, pretend_gpus, reference_run, run_train
from hydra.errors import ConfigCompositionException, OverrideParseException
from safetensors.torch import save_file

from src.components.models import GPT
from src.config.base import ConfigError
from src.config.schema import composition_error_line
from src.training.build import check_config

HYDRA, CHECK = "hydra", "check"
ODD = "tests.odd_models"
NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is visible")
CUDA = pytest.mark.cuda
NEEDS_GPU = needs_gpus(1)
NEEDS_GPU_WITHOUT_BF16 = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.is_bf16_supported(including_emulation=False),
    reason="needs a GPU without bf16",
)

# (overrides on top of TINY, where it is refused, what the message must say). {finished},
# {truncated} and {foreign} are files made by the test: a finished run's checkpoint (6 of 6 steps,
# MLP hidden=32, adamw), that checkpoint cut in half, and a torch file that is no checkpoint;
# {gpt2} and {llama} transformers folders (`files`). data=text on the text file the `files`
# fixture writes (char: its 11 characters and the end-of-text token).
TEXT = ("model=gpt", "data=text", "data.path={text}", "data.tokenizer=char", "data.seq_len=4")
# data=hf_dataset on the records the `files` fixture writes (`records`: 20 short documents).
STREAM = ("model=gpt", "data=hf_dataset", "data.tokenizer=char", "data.seq_len=4")
STREAM_RECORDS = (*STREAM, "data.path={records}", "data.val_documents=2", "data.test_documents=2")
NEEDS_DATASETS = pytest.mark.skipif(
    importlib.util.find_spec("datasets") is None, reason="needs datasets (requirements-dev.txt)"
)
ROWS = [
    pytest.param(
        ["parallel=nosuch"],
        HYDRA,
        "Could not find 'parallel/nosuch'; choose one of auto, cp, ddp, dp, dp_criterion, ep, "
        "fsdp, fsdp_cp_tp, fsdp_tp, fsdp_tp_pp, hybrid, mesh, model_parallel, pp, single, tp",
        id="strategy",
    ),
    pytest.param(
        ["model=nosuch"],
        HYDRA,
        "Could not find 'model/nosuch'; choose one of convnet, fcn, gpt, gpt2_124m, "
        "hf_causal_lm, hf_image_classifier, mlp, moe, resnet, timm, transformer",
        id="model",
    ),
    pytest.param(
        ["parallel._target_=src.parallel.nosuch.Nosuch"],
        CHECK,
        "parallel._target_=src.parallel.nosuch.Nosuch names no class: No module named "
        "'src.parallel.nosuch'",
        id="strategy-class",
    ),
    pytest.param(["parallel.devices=0"], CHECK, "parallel.devices must be at least 1", id="dev0"),
    pytest.param(
        [f"model._target_={ODD}.LoopMLP", "+model.width=8", "+model.layers=2", "+model.wide=1"],
        CHECK,
        f"model: {ODD}.LoopMLP takes no 'wide'; it takes input_shape, layers, num_classes, width",
        id="model-setting",
    ),
    pytest.param(
        [
            f"model._target_={ODD}.LongSkipLoopMLP",
            "+model.width=8",
            "+model.layers=3",
            "parallel=model_parallel",
            "parallel.devices=3",
        ],
        CHECK,
        # the stem's output, needed after the middle stage, which torch's stages cannot hand on
        "parallel.devices: torch's pipeline tracer cannot cut LongSkipLoopMLP before layers.1, "
        "layers.2",
        id="stages-of-a-model-the-tracer-cannot-cut",
    ),
    pytest.param(
        [
            f"model._target_={ODD}.LoopMLP",
            "+model.width=8",
            "+model.layers=2",
            "parallel=pp",
            "parallel.devices=4",
            "parallel.tp=2",
        ],
        CHECK,
        "parallel.pp cuts LoopMLP (not an nn.Sequential) into traced stages, which tensor "
        "parallel and FSDP (parallel.tp, parallel.dp_shard, and parallel.dp_replicate beside pp) "
        "cannot wrap; run pp alone (parallel=pp, one process per stage), or those without pp",
        id="traced-pipeline-with-tp",
    ),
    pytest.param(
        [
            f"model._target_={ODD}.LoopMLP",
            "+model.width=8",
            "+model.layers=2",
            "parallel=pp",
            "parallel.schedule=Interleaved1F1B",
            "parallel.stages_per_rank=2",
        ],
        CHECK,
        "parallel.pp x parallel.stages_per_rank = 4 stages, but the model has only 2 blocks",
        id="traced-pipeline-of-too-few-blocks",
    ),
    pytest.param(
        [
            f"model._target_={ODD}.LoopMLP",
            "+model.width=8",
            "+model.layers=2",
            "+model.blocks=nosuch",
        ],
        CHECK,
        "model.blocks=nosuch: no module of the model is one of these classes, nor a module's path",
        id="model-blocks",
    ),
    pytest.param(
        ["model=hf_causal_lm", "model.config=nosuch"],
        CHECK,
        "model.config=nosuch: transformers has no such model type",
        id="hf-model-type",
    ),
    pytest.param(
        ["model=hf_causal_lm", "model.pretrained={config_only}"],
        CHECK,
        "holds no weights (model.safetensors",
        id="hf-pretrained-without-weights",
    ),
    pytest.param(
        ["model=timm", "model.name=nosuch", "data.image_shape=[3,8,8]", "data.input_dim=192"],
        CHECK,
        "model.name=nosuch: timm has no such model",
        id="timm-name",
    ),
    pytest.param(
        ["data.test_fraction=0"],
        CHECK,
        "trainer.test=true scores the test split, but data.test_fraction=0 leaves none; set "
        "trainer.test=false, or data.test_fraction above 0",
        id="test-without-test-split",
    ),
    pytest.param(
        ["parallel=ddp", "parallel.nodes=2:1"],
        CHECK,
        "parallel.nodes=2:1: MIN:MAX needs 1 <= MIN < MAX (e.g. 1:2); for a fixed number of "
        "nodes give one number",
        id="nodes-range",
    ),
    pytest.param(
        ["parallel=ddp", "parallel.nodes=two"],
        CHECK,
        "parallel.nodes=two: give a number of nodes, or MIN:MAX (e.g. 1:2) for an elastic job",
        id="nodes-form",
    ),
    pytest.param(
        ["parallel=ddp", "parallel.max_restarts=-1"],
        CHECK,
        "parallel.max_restarts must be 0 or more, got -1",
        id="max-restarts",
    ),
    pytest.param(
        ["trainer.eval_batch_size=0"],
        CHECK,
        "trainer.eval_batch_size must be at least 1 (or null), got 0",
        id="eval-batch0",
    ),
    pytest.param(
        ["trainer.progress_every_s=-1"],
        CHECK,
        "trainer.progress_every_s must be 0 or more (or null), got -1",
        id="progress-every-negative",
    ),
    pytest.param(
        ["trainer.matmul_precision=tf32"],
        HYDRA,
        "Invalid value 'tf32', expected one of [auto, highest, high, medium]",
        id="matmul-precision",
    ),
    pytest.param(["parallel.devices=2"], CHECK, "parallel=single uses one device", id="single2"),
    pytest.param(
        ["parallel=model_parallel", "parallel.devices=5"],
        CHECK,
        "parallel.devices=5 stages but the model has only 4 blocks",
        id="more-stages-than-blocks",
    ),
    pytest.param(
        ["parallel=model_parallel", "parallel.microbatches=30"],
        CHECK,
        "is 24 samples, too few for parallel.microbatches=30",
        id="more-microbatches-than-samples",
    ),
    pytest.param(
        ["parallel=model_parallel", "trainer.accelerator=cpu", "parallel.split_points=[4]"],
        CHECK,
        "parallel.split_points=[4] reaches past the model's last block (index 3)",
        id="split-past-last-block",
    ),
    pytest.param(
        ["parallel=model_parallel", "trainer.accelerator=cuda", "parallel.devices=99"],
        CHECK,
        "parallel.devices=99 but only",
        id="model-parallel-more-devices-than-gpus",
        marks=[CUDA, NEEDS_GPU],
    ),
    pytest.param(
        ["parallel=hybrid", "trainer.accelerator=cpu", "parallel.devices=10", "parallel.stages=5"],
        CHECK,
        "parallel.stages=5 stages but the model has only 4 blocks",
        id="hybrid-more-stages-than-blocks",
    ),
    pytest.param(
        ["parallel=hybrid", "trainer.accelerator=cpu", "parallel.devices=3", "parallel.stages=2"],
        CHECK,
        "parallel.devices=3 does not divide into processes of parallel.stages=2 devices each",
        id="hybrid-devices-not-multiple-of-stages",
    ),
    pytest.param(
        ["parallel=hybrid", "trainer.accelerator=cpu", "parallel.devices=2", "parallel.stages=2"],
        CHECK,
        "is a single process, with nothing to run data-parallel: use parallel=model_parallel "
        "parallel.devices=2",
        id="hybrid-single-process",
    ),
    pytest.param(
        ["parallel=hybrid", "trainer.accelerator=cpu", "parallel.devices=10", "parallel.stages=2"],
        CHECK,
        "does not split evenly over 5 processes (parallel.devices=10 / parallel.stages=2 x "
        "parallel.nodes=1)",
        id="hybrid-batch-over-processes",
    ),
    pytest.param(
        ["parallel=hybrid", "trainer.accelerator=cpu", "parallel.microbatches=13"],
        CHECK,
        "is 12 samples, too few for parallel.microbatches=13",
        id="hybrid-more-microbatches-than-samples",
    ),
    pytest.param(
        ["parallel=hybrid", "trainer.accelerator=cuda", "parallel.devices=98"],
        CHECK,
        "parallel.devices=98 but only",
        id="hybrid-more-devices-than-gpus",
        marks=[CUDA, NEEDS_GPU],
    ),
    pytest.param(
        ["parallel=fsdp", "trainer.accelerator=cpu", "parallel.devices=5"],
        CHECK,
        "(trainer.batch_size / trainer.accumulate = 24) does not split evenly over 5 processes "
        "(parallel.devices=5 x parallel.nodes=1)",
        id="fsdp-batch-over-ranks",
    ),
    pytest.param(
        ["parallel=ddp", "parallel.static_graph=true", "trainer.accumulate=2"],
        CHECK,
        "parallel.static_graph=true cannot run with trainer.accumulate=2",
        id="ddp-static-graph-accumulate",
    ),
    pytest.param(
        ["parallel=hybrid", "parallel.static_graph=true", "trainer.accumulate=2"],
        CHECK,
        "parallel.static_graph=true cannot run with trainer.accumulate=2",
        id="hybrid-static-graph-accumulate",
    ),
    pytest.param(
        ["parallel=fsdp", "parallel.static_graph=true"],
        CHECK,
        "parallel.static_graph=true: DDP's reducer options, but the layout fsdp2 is not "
        "dp_replicate alone and runs FSDP2",
        id="fsdp-reducer-option",
    ),
    pytest.param(
        ["parallel=fsdp_tp", "parallel.stages=2"],
        CHECK,
        "parallel.stages=2 cuts each process's model over its own devices under dp_replicate "
        "alone (DDP); with tp, pp or dp_shard set, use parallel.pp",
        id="stages-beside-tp",
    ),
    pytest.param(
        ["parallel=hybrid", "parallel.deferred_batchnorm=true", "parallel.sync_batchnorm=true"],
        CHECK,
        "parallel.deferred_batchnorm=true and parallel.sync_batchnorm=true both replace BatchNorm",
        id="hybrid-deferred-and-synced-batchnorm",
    ),
    pytest.param(
        [
            "parallel=model_parallel",
            "parallel.deferred_batchnorm=true",
            "trainer.activation_checkpointing=true",
        ],
        CHECK,
        "parallel.deferred_batchnorm=true cannot run with trainer.activation_checkpointing=full",
        id="deferred-batchnorm-with-activation-checkpointing",
    ),
    pytest.param(
        ["trainer.activation_checkpointing=some"],
        CHECK,
        "trainer.activation_checkpointing must be one of none, full, selective (or true, false), "
        "got 'some'",
        id="activation-checkpointing",
    ),
    pytest.param(
        ["trainer.activation_checkpointing=selective", "trainer.checkpoint_ops=[mm,matmull]"],
        CHECK,
        "trainer.checkpoint_ops: torch has no aten op 'matmull'",
        id="checkpoint-ops",
    ),
    pytest.param(
        ["trainer.activation_checkpointing=selective", "trainer.compile=true"],
        CHECK,
        "trainer.activation_checkpointing=selective cannot run with trainer.compile=true",
        id="selective-checkpointing-compiled",
    ),
    pytest.param(
        ["parallel=fsdp", "parallel.offload=cpu", "trainer.accelerator=cpu"],
        CHECK,
        "parallel.offload=cpu moves FSDP's shards from GPU memory to the host, and this run is "
        "on the CPU",
        id="offload-on-cpu",
    ),
    pytest.param(
        ["parallel=tp", "parallel.offload=cpu"],
        CHECK,
        "parallel.offload=cpu moves FSDP's shards to the host, but parallel.dp_shard=1",
        id="offload-without-dp-shard",
    ),
    pytest.param(
        ["parallel=ddp", "trainer.accelerator=cpu", "parallel.microbatches=4"],
        CHECK,
        "parallel.microbatches=4: pipeline settings, but this layout has no pipeline",
        id="pipeline-setting-without-pipeline",
    ),
    pytest.param(
        ["parallel=ddp", "parallel.offload=cpu"],
        CHECK,
        "parallel.offload=cpu moves FSDP's shards to the host, but parallel.dp_shard=1",
        id="offload-under-ddp",
    ),
    pytest.param(
        ["parallel=ddp", "trainer.accelerator=cpu", "parallel.backend=mpi"],
        HYDRA,
        "Invalid value 'mpi', expected one of [gloo, nccl]",
        id="ddp-backend",
    ),
    pytest.param(
        ["parallel=ddp", "trainer.accelerator=cpu", f"model._target_={ODD}.FrozenMLP"],
        CHECK,
        f"model: {ODD}.FrozenMLP has no trainable parameters",
        id="nothing-to-train",
    ),
    pytest.param(
        [f"model._target_={ODD}.DictOutputMLP"],
        CHECK,
        f"model: {ODD}.DictOutputMLP returns outputs shaped {{'logits': [2, 10]}} for inputs "
        "shaped [2, 32] and targets shaped [2], but for Classification the outputs must be one "
        "tensor, not a dict",
        id="dict-output",
    ),
    pytest.param(
        [
            "parallel=model_parallel",
            "parallel.microbatches=2",
            "parallel.split_points=[2]",
            f"model._target_={ODD}.FloatBoundaryMLP",
        ],
        CHECK,
        "parallel.split_points=[2]: block 1 returns a tuple holding a float, which cannot be "
        "handed to a stage starting at block 2",
        id="stage-boundary-not-tensors",
    ),
    pytest.param(
        [
            "parallel=hybrid",
            "trainer.accelerator=cpu",
            "parallel.devices=8",
            "parallel.stages=4",
            f"model._target_={ODD}.FloatBoundaryMLP",
        ],
        CHECK,
        "parallel.stages=4 stages need 3 block boundaries to cut at, but only 2 of the model's 3 "
        "pass tensors (no stage can start at block 2 (block 1 returns a tuple holding a float))",
        id="hybrid-no-split-passes-tensors",
    ),
    pytest.param(
        ["trainer.max_steps=abc"],
        HYDRA,
        "Error merging override trainer.max_steps=abc: Value 'abc' of type 'str' could not be "
        "converted to Integer",
        id="not-an-int",
    ),
    pytest.param(
        ["trainer.max_stepz=5"],
        HYDRA,
        "Could not override 'trainer.max_stepz': Key 'max_stepz' not in 'TrainerConfig'; did you "
        "mean max_steps?",
        id="typo",
    ),
    pytest.param(
        ["model.widht=5"],
        HYDRA,
        "Key 'widht' not in 'MLPConfig'; the keys there: _target_, hidden, depth",
        id="typo-nothing-close",
    ),
    pytest.param(
        ["trainer.max_steps"],
        HYDRA,
        "Error parsing override 'trainer.max_steps': missing EQUAL at '<EOF>'",
        id="override-syntax",
    ),
    pytest.param(
        ["trainer.accumulate=5"],
        CHECK,
        "trainer.batch_size=24 does not divide into trainer.accumulate=5 micro-batches",
        id="accumulate",
    ),
    pytest.param(
        ["trainer.batch_size=1000"],
        CHECK,
        "trainer.batch_size=1000 is more than the 540 training samples",
        id="batch-over-data",
    ),
    pytest.param(
        ["trainer.accelerator=cuda"],
        CHECK,
        "trainer.accelerator=cuda but no GPU is visible; use auto or cpu",
        id="cuda-without-gpu",
        marks=NO_GPU,
    ),
    pytest.param(
        ["trainer.accelerator=cuda", "trainer.precision=bf16"],
        CHECK,
        "trainer.precision=bf16 but this GPU has no bf16 support; use fp32",
        id="bf16-unsupported",
        marks=[CUDA, NEEDS_GPU_WITHOUT_BF16],
    ),
    pytest.param(
        ["parallel=ddp", "trainer.accelerator=cuda", "parallel.devices=99"],
        CHECK,
        "parallel.devices=99 but only",
        id="ddp-more-devices-than-gpus",
        marks=[CUDA, NEEDS_GPU],
    ),
    pytest.param(
        ["optimizer.schedule=linnear"],
        CHECK,
        "optimizer.schedule=linnear: choose one of constant, linear, cosine, wsd, or a "
        "learning-rate scheduler class by its path",
        id="schedule",
    ),
    pytest.param(
        ["optimizer.schedule=wsd", "optimizer.decay_fraction=1.5"],
        CHECK,
        "optimizer.decay_fraction=1.5: the fraction of the steps that wsd's decay takes must be "
        "in (0, 1]",
        id="wsd-decay-fraction",
    ),
    pytest.param(
        ["optimizer._target_=torch.optim.Nosuch"],
        CHECK,
        "optimizer._target_=torch.optim.Nosuch does not import: No module named "
        "'torch.optim.Nosuch'",
        id="optimizer-target",
    ),
    pytest.param(
        ["optimizer=sgd", "optimizer._target_=torch.optim.Adagrad", "+optimizer.betas=[0.9,0.99]"],
        CHECK,
        "optimizer: torch.optim.Adagrad takes no 'betas'; it takes differentiable, eps, foreach",
        id="optimizer-arguments",
    ),
    pytest.param(["optimizer.lr=-1"], CHECK, "optimizer: Invalid learning rate", id="lr"),
    pytest.param(
        ["optimizer=muon", "model=fcn", "data=synthetic_segmentation", "task=segmentation"],
        CHECK,
        "optimizer=muon steps the 2-D weight matrices of the model's blocks apart, and this "
        "model's blocks hold none",
        id="muon-without-block-matrices",
    ),
    pytest.param(
        ["optimizer=muon", "optimizer.adjust_lr_fn=nosuch"],
        CHECK,
        "optimizer: Adjust learning rate function nosuch is not supported",
        id="muon-adjust-lr-fn",
    ),
    pytest.param(
        ["optimizer=muon", "optimizer.block_matrices_apart=false"],
        CHECK,
        "optimizer: src.components.muon.muon steps the blocks' matrices apart; choose "
        "optimizer=muon, or set optimizer.block_matrices_apart=true",
        id="muon-matrices-together",
    ),
    pytest.param(
        ["model=convnet"], CHECK, "model=convnet needs image-shaped input", id="convnet-flat-data"
    ),
    pytest.param(
        ["model=gpt", "data=synthetic"],
        CHECK,
        "model: src.components.models.GPT looks token ids up in an embedding, but the data gives "
        "real-valued inputs shaped [2, 32]; use token data",
        id="gpt-float-inputs",
    ),
    pytest.param(
        ["data._target_=tests.odd_data.halves_and_values"],
        CHECK,
        "model: src.components.models.MLP cannot take inputs shaped {'left': [2, 16], 'right': "
        "[2, 16]} (AttributeError: 'dict' object has no attribute 'flatten'); choose a data option",
        id="mlp-dict-inputs",
    ),
    pytest.param(
        ["model=transformer", "data=synthetic_tokens", "model.heads=5"],
        CHECK,
        "model.hidden (64) must divide by model.heads (5)",
        id="heads",
    ),
    pytest.param(
        ["model=moe", "data=synthetic_tokens", "task=language_model", "model.top_k=3"],
        CHECK,
        "model.top_k must be 1 or 2 and at most model.experts (4), got 3",
        id="moe-top-k",
    ),
    pytest.param(
        ["parallel=cp"],
        CHECK,
        "parallel.cp splits sequences for attention, and the model runs none",
        id="cp-without-attention",
    ),
    pytest.param(
        ["model=transformer", "data=synthetic_tokens", "data.seq_len=6", "parallel=cp"],
        CHECK,
        "parallel.cp=2 cuts each sequence into 2 x cp = 4 equal chunks, and its 6 tokens",
        id="cp-sequence",
    ),
    pytest.param(
        ["model=moe", "data=synthetic_tokens", "task=language_model", "parallel=cp"],
        CHECK,
        "parallel.cp splits the loss along the sequence, and the model's outputs are not one",
        id="cp-moe",
    ),
    pytest.param(
        [
            "model=transformer",
            "data=synthetic_tokens",
            "parallel=cp",
            "parallel.pp=2",
            "parallel.devices=4",
        ],
        CHECK,
        "parallel.cp does not run with parallel.pp > 1 yet",
        id="cp-pp",
    ),
    pytest.param(
        ["data.augment=true"],
        CHECK,
        "data.augment=true crops and flips images (channels, height, width), but this set's "
        "inputs are shaped (32,); set data.augment=false",
        id="augment-not-images",
    ),
    pytest.param(
        ["logger=nosuch"],
        HYDRA,
        "Could not find 'logger/nosuch'; choose one of csv, many, mlflow, none, tensorboard, wandb",
        id="logger",
    ),
    pytest.param(["logger=[csv,nosuch]"], HYDRA, "Could not load 'logger/nosuch'.", id="loggers"),
    pytest.param(
        ["logger=wandb", "logger.wandb.mode=onlin"],
        HYDRA,
        "Invalid value 'onlin', expected one of [offline, online, shared, disabled]",
        id="wandb-mode",
    ),
    pytest.param(
        ["parallel=dp", "trainer.checkpoint_format=sharded"],
        CHECK,
        "trainer.checkpoint_format=sharded is for parallel=single, ddp, fsdp and the mesh layouts "
        "(tp, pp, fsdp_tp), not dp",
        id="sharded-dp",
    ),
    pytest.param(
        ["trainer.async_checkpoint=true"],
        CHECK,
        "trainer.async_checkpoint=true writes sharded checkpoints only",
        id="async-full",
    ),
    pytest.param(
        ["trainer.resume=/nonexistent/last.pt"],
        CHECK,
        "trainer.resume: no checkpoint at /nonexistent/last.pt",
        id="resume-missing",
    ),
    pytest.param(
        ["trainer.resume={truncated}"],
        CHECK,
        "is not a checkpoint, or it was cut short",
        id="resume-truncated",
    ),
    pytest.param(
        ["trainer.resume={foreign}"],
        CHECK,
        "is not a checkpoint written by train.py",
        id="resume-foreign",
    ),
    pytest.param(
        ["trainer.resume={finished}", "model.hidden=64", "trainer.max_steps=12"],
        CHECK,
        "holds a different model (0.1.bias: [32] there, [64] here); it was trained with "
        "src.components.models.MLP model.hidden=32 model.depth=3",
        id="resume-other-model",
    ),
    pytest.param(
        ["trainer.resume={finished}", "optimizer=sgd", "trainer.max_steps=12"],
        CHECK,
        "was trained with optimizer=adamw",
        id="resume-other-optimizer",
    ),
    pytest.param(
        ["trainer.resume={finished}"],
        CHECK,
        "is at step 6 and trainer.max_steps=6, so there is nothing left to train",
        id="resume-finished",
    ),
    pytest.param(
        ["trainer.resume={finished}", "trainer.max_steps=12", "optimizer.warmup_steps=0"],
        CHECK,
        "was trained with a cosine schedule over 6 steps; trainer.max_steps=12 would rescale it "
        "to 12 steps, changing the learning rate from step 7 on (0.00055 instead of 0.0001). Set "
        "optimizer.schedule_steps=6 to keep the schedule (later steps keep its final rate), or "
        "optimizer.schedule_steps=12 to stretch it",
        id="resume-stretches-schedule",
    ),
    pytest.param(
        ["trainer.monitor=val/nosuch"],
        CHECK,
        "trainer.monitor=val/nosuch is never logged: task src.components.tasks.Classification "
        "logs val/loss, val/accuracy, train/loss, train/accuracy; choose one of them, or "
        "trainer.monitor=null for no best checkpoint",
        id="monitor-unknown",
    ),
    pytest.param(
        ["data=synthetic_regression", "task=regression", "trainer.monitor=val/accuracy"],
        CHECK,
        "trainer.monitor=val/accuracy is never logged: task src.components.tasks.Regression logs "
        "val/loss, val/mae, train/loss, train/mae",
        id="monitor-not-of-the-task",
    ),
    pytest.param(
        ["trainer.monitor=null", "trainer.early_stop_patience=3"],
        CHECK,
        "trainer.early_stop_patience=3 watches trainer.monitor, which is null",
        id="early-stop-without-monitor",
    ),
    pytest.param(
        ["trainer.eval_every=0", "trainer.early_stop_patience=3"],
        CHECK,
        "trainer.early_stop_patience=3 counts evaluations, but trainer.eval_every=0 evaluates "
        "only after the last step",
        id="early-stop-without-evaluations",
    ),
    pytest.param(
        ["trainer.ema_decay=1.0"],
        CHECK,
        "trainer.ema_decay must be between 0 and 1 (both excluded; 0.999 is usual) or null, "
        "got 1.0",
        id="ema-decay",
    ),
    pytest.param(
        ["trainer.ema_eval=true"],
        CHECK,
        "trainer.ema_eval=true scores the weight average, but trainer.ema_decay is null",
        id="ema-eval-without-ema",
    ),
    pytest.param(
        ["trainer.monitor_mode=up"],
        HYDRA,
        "Invalid value 'up', expected one of [min, max]",
        id="monitor-mode",
    ),
    pytest.param(
        ["trainer.init_from=/nonexistent/weights.pt"],
        CHECK,
        "trainer.init_from: no file or folder /nonexistent/weights.pt; give a checkpoint folder, "
        "a run folder, a .pt or .safetensors weights file, or a transformers folder",
        id="init-from-missing",
    ),
    pytest.param(
        ["trainer.init_from={truncated}"],
        CHECK,
        "truncated.pt is not a checkpoint, or it was cut short; give a checkpoint folder",
        id="init-from-truncated",
    ),
    pytest.param(
        ["trainer.init_from={finished}", "model.depth=4"],
        CHECK,
        "does not fit this model: 4 keys missing (first 3.0.weight); 2 keys it does not have "
        "(first 3.weight); set trainer.init_strict=false to load the keys that fit",
        id="init-from-other-keys",
    ),
    pytest.param(
        ["trainer.init_from={finished}", "trainer.init_strict=false", "model.hidden=64"],
        CHECK,
        "does not fit this model: 7 shapes differ (first 0.1.weight: [32, 32] in the file, "
        "[64, 32] here)",
        id="init-from-other-shapes",
    ),
    pytest.param(
        ["model=gpt", "data=synthetic_tokens", "trainer.init_from={llama}"],
        CHECK,
        "llama is a LlamaForCausalLM, not GPT-2 (GPT2LMHeadModel), the only weights model=gpt "
        "starts from; to train that model as it is, choose model=hf_causal_lm "
        "model.pretrained=<its folder>",
        id="init-from-not-gpt2",
    ),
    pytest.param(
        ["model=gpt", "data=synthetic_tokens", "data.seq_len=32", "trainer.init_from={gpt2}"],
        CHECK,
        "gpt2 is a GPT-2 of other sizes than this model's: set model.n_embd=32 model.gelu=tanh "
        "(here 64, erf); its vocabulary is 16 tokens (data.vocab_size rounded up to "
        "model.vocab_multiple: 64 here); data.seq_len at most 8 (its positions; 32 here)",
        id="init-from-gpt2-of-other-sizes",
    ),
    pytest.param(
        ["data=tokens"],
        CHECK,
        "data.path must be given: the chosen options leave no value (data.path=...)",
        id="tokens-without-path",
    ),
    pytest.param(
        [*TEXT, "data.path={no_text}"],
        CHECK,
        "no-text holds no text files (.txt, .jsonl, .json, .parquet, each optionally .gz)",
        id="text-without-text-files",
    ),
    pytest.param(
        [*TEXT, "data.path={jsonl}"],
        CHECK,
        "records.jsonl line 1 has no such text field (its fields: body); name the field that "
        "holds the text",
        id="jsonl-without-text-field",
    ),
    pytest.param(
        [*TEXT, "data.tokenizer={config_only}/config.json"],
        CHECK,
        "config.json: tokenizers cannot load it: ",
        id="tokenizer-unreadable",
    ),
    pytest.param(
        [*TEXT, "data.tokenizer=gpt2"],
        CHECK,
        "data.tokenizer=gpt2: tiktoken could not download its BPE (no network?): give a local "
        "copy, data.tokenizer=/path/to/r50k_base.tiktoken",
        id="gpt2-offline",
    ),
    pytest.param(
        [*TEXT, "data.vocab_size=4"],
        CHECK,
        "data.tokenizer=char has 12 tokens, more than data.vocab_size=4 (the model's vocabulary)",
        id="vocabulary-over-the-model-s",
    ),
    pytest.param(
        [*STREAM, "data.path={no_text}/nosuch"],
        CHECK,
        "no-text/nosuch: no such file or folder (a data set on the hub is named owner/name)",
        id="stream-without-path",
        marks=NEEDS_DATASETS,
    ),
    pytest.param(
        [*STREAM, "data.path={jsonl}"],
        CHECK,
        "records.jsonl has no such text field (its fields: body); name the field that holds "
        "the text",
        id="stream-without-text-field",
        marks=NEEDS_DATASETS,
    ),
    pytest.param(
        [*STREAM_RECORDS, "parallel=ddp", "parallel.devices=3", "data.streams=2"],
        CHECK,
        "data.streams=2 cannot be shared by 3 data-parallel processes: set data.streams to a "
        "multiple of 3",
        id="stream-over-other-processes",
        marks=NEEDS_DATASETS,
    ),
    pytest.param(
        ["optimizer.schedule_steps=0"],
        CHECK,
        "optimizer.schedule_steps must be at least 1, or null for trainer.max_steps; got 0",
        id="schedule-steps",
    ),
]


def with_overrides(base: tuple[str, ...], overrides: list[str]) -> list[str]:
    """`base` without what `overrides` replace (`data=tokens` also drops `data.*`), then them."""
    keys = [override.split("=")[0] for override in overrides]
    kept = [
        option
        for option in base
        if not any(option.split("=")[0] == key or option.startswith(f"{key}.") for key in keys)
    ]
    return kept + overrides


@pytest.fixture
def files(tmp_path, monkeypatch):
    finished = reference_run(*TINY) / "checkpoints" / "step-000006"
    truncated = tmp_path / "truncated.pt"
    whole = (finished / "checkpoint.pt").read_bytes()
    truncated.write_bytes(whole[: len(whole) // 2])
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.ones(3)}, foreign)
    config_only = tmp_path / "config-only"  # a transformers folder without its weights
    config_only.mkdir()
    (config_only / "config.json").write_text('{"model_type": "llama", "hidden_size": 32}')
    text = tmp_path / "text.txt"
    text.write_text("the cat sat on a mat. " * 50)
    jsonl = tmp_path / "records.jsonl"
    jsonl.write_text('{"body": "no text field"}\n')
    records = tmp_path / "records-to-stream.jsonl"
    records.write_text("".join(f'{{"text": "the cat sat on mat {i}"}}\n' for i in range(20)))
    no_text = tmp_path / "no-text"
    no_text.mkdir()
    (no_text / "notes.md").write_text("not one of the text formats")
    # As on a machine without network, with tiktoken's download cache empty.
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "tiktoken"))
    gpt2 = tmp_path / "gpt2"  # GPT-2 as transformers writes it, 32 wide, 8 positions, 16 tokens
    GPT((8,), 16, n_layer=2, n_head=2, n_embd=32, gelu="tanh").save_pretrained(gpt2)
    llama = tmp_path / "llama"  # a transformers folder of another architecture
    llama.mkdir()
    (llama / "config.json").write_text(
        '{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}'
    )
    save_file({"model.embed_tokens.weight": torch.zeros(16, 8)}, llama / "model.safetensors")
    return {
        "text": text,
        "jsonl": jsonl,
        "records": records,
        "no_text": no_text,
        "finished": finished,
        "truncated": truncated,
        "foreign": foreign,
        "config_only": config_only,
        "gpt2": gpt2,
        "llama": llama,
    }


@pytest.mark.parametrize("overrides, stage, message", ROWS)
def test_bad_input_is_refused_before_any_work(
    tmp_path, files, compose_config, overrides, stage, message
):
    overrides = with_overrides(TINY, [override.format(**files) for override in overrides])
    if stage == HYDRA:
        with pytest.raises((ConfigCompositionException, OverrideParseException)) as refused:
            compose_config(*overrides)
        assert message in composition_error_line(refused.value)
        return
    run_dir = tmp_path / "run"
    with pytest.raises(ConfigError) as refused:
        check_config(compose_config(*overrides), run_dir)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)
    assert not run_dir.exists(), "a refused run wrote files"


def test_a_stream_without_datasets_names_the_package(tmp_path, files, compose_config, monkeypatch):
    """data=hf_dataset where `datasets` is not installed (an import of it fails): one line."""
    monkeypatch.setitem(sys.modules, "datasets", None)
    overrides = with_overrides(TINY, [override.format(**files) for override in STREAM_RECORDS])
    with pytest.raises(ConfigError) as refused:
        check_config(compose_config(*overrides), tmp_path / "run")
    assert str(refused.value) == "data=hf_dataset needs datasets: pip install datasets"


@pytest.mark.parametrize(
    "overrides, stage, message",
    [
        (["parallel=nosuch"], HYDRA, "Could not find 'parallel/nosuch'; choose one of auto, cp,"),
        (
            ["parallel=ddp", "trainer.accelerator=cpu", "parallel.nodes=2"],
            CHECK,
            "parallel.nodes > 1 needs a rendezvous every node can reach: set parallel.master_addr",
        ),
        (["trainer.monitor=val/nosuch"], CHECK, "trainer.monitor=val/nosuch is never logged"),
        (
            # an open dict that starts empty: Hydra's `+` adds a key to it
            ["model=timm", "model.sizes.img_size=16"],
            HYDRA,
            "Key 'img_size' is not in struct; model.sizes has no keys yet: add one with "
            "+model.sizes.img_size=16",
        ),
        (
            [f"model._target_={ODD}.LoopMLP", "+model.width=8"],
            CHECK,
            f"model: {ODD}.LoopMLP needs 'layers', which its config does not give: add "
            "+model.layers=<value>",
        ),
        (
            ["data._target_=tests.nosuch.builder"],
            CHECK,
            "data._target_=tests.nosuch.builder does not import: No module named 'tests.nosuch'",
        ),
        (
            ["data._target_=tests.odd_data.vectors"],
            CHECK,
            "data: tests.odd_data.vectors takes no 'image_shape'; it takes input_dim, "
            "num_classes, num_samples, seed; a data builder gets every setting of its data "
            "option: take them, or **settings",
        ),
        (
            ["task._target_=tests.nosuch.Task"],
            CHECK,
            "task._target_=tests.nosuch.Task does not import: No module named 'tests.nosuch'",
        ),
        (
            [
                "model=fcn",
                "data=synthetic_segmentation",
                "task=segmentation",
                "task._target_=tests.odd_tasks.BrierScore",
            ],
            CHECK,
            "task: tests.odd_tasks.BrierScore takes no 'ignore_index'; it takes no settings; a "
            "task gets every setting of its task option: take them, or **settings",
        ),
        (
            # the default data's inputs are vectors; ddp: refused before any rank starts
            ["model=timm", "parallel=ddp", "parallel.devices=2"],
            CHECK,
            "model=timm takes images shaped (channels, height, width), but the data's inputs "
            "are shaped [32]",
        ),
        (
            ["model=hf_image_classifier"],
            CHECK,
            "model=hf_image_classifier takes images shaped (channels, height, width), but the "
            "data's inputs are shaped [32]",
        ),
        (
            ["parallel=ddp", "parallel.devices=2", "parallel.nodes=2:3", "trainer.batch_size=18"],
            CHECK,
            "on 2 node(s) of parallel.nodes=2:3: the global micro-batch (trainer.batch_size / "
            "trainer.accumulate = 18) does not split evenly over 4 processes",
        ),
    ],
    ids=[
        "hydra",
        "ddp-nodes-without-rendezvous",
        "monitor",
        "key-of-an-empty-dict",
        "model-setting-missing",
        "data-builder-import",
        "data-builder-setting",
        "task-class-import",
        "task-class-setting",
        "timm-without-images",
        "hf-image-classifier-without-images",
        "elastic-fewer-nodes",
    ],
)
def test_train_py_reports_bad_input_in_one_line(tmp_path, overrides, stage, message):
    run_dir = tmp_path / "run"
    result = run_train(*with_overrides(TINY, overrides), run_dir=run_dir, check=False)

    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert message in output
    assert "Traceback" not in output
    if stage == CHECK:
        assert output.count("[ERROR]") == 1, output
    else:
        assert len(output.splitlines()) == 1 and output.startswith("train.py: error: "), output
    left = {path.name for path in run_dir.iterdir()} if run_dir.exists() else set()
    assert left <= {".hydra", "train.log"}, f"a refused run wrote {left}"


def test_bf16_on_a_gpu_that_only_emulates_it_is_refused(monkeypatch, compose_config, tmp_path):
    """V100 and T4 report bf16 support unless emulation is left out."""
    cfg = compose_config(*TINY, "trainer.accelerator=cuda", "trainer.precision=bf16")
    pretend_gpus(monkeypatch, 1)
    emulating = lambda including_emulation=True: including_emulation  # noqa: E731
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", emulating)
    with pytest.raises(ConfigError, match="trainer.precision=bf16 but this GPU has no bf16"):
        check_config(cfg, tmp_path)
