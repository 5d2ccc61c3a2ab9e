"""Check, in seconds and without a GPU, that gpu_bundle/ (scripts/prepare_gpu_run.py) is ready to use here.

    python3 scripts/check_gpu_bundle.py        # after installing gpu_bundle/wheels (docs/performance.md)

1. kiln's dependencies import: torch, torchao, datasets (and their versions are printed).
2. torchtitan 0.2.2 parses gpu_bundle/torchtitan/llama3_8b_8l.toml with the flags run.sh adds.
3. The registered flavour 8B_8L builds (meta device) with exactly as many parameters as kiln's llama3_8b_8l
   benchmark model: the side-by-side rows train the same shape.
4. torchtitan's tokenizer (tokenizer.json) gives the same ids as kiln's tiktoken tokenizer on corpus documents.
5. torchtitan's dataset loader reads the bundled corpus and yields a full-length sample.
Exits 1 naming the first check that failed.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BUNDLE = ROOT / "gpu_bundle" / "torchtitan"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(BUNDLE))
# The model flags of benchmarks/run.py's llama3_8b_8l preset (tests/e2e/test_benchmarks.py keeps the two equal).
KILN_SHAPE = ["--job.config_file", "train_configs/llama3_8b.toml", "--model.n_layers", "8"]
KILN_SHAPE += ["--model.vocab_size", "128256", "--training.seq_len", "8192", "--training.local_batch_size", "1"]
KILN_SHAPE += ["--model.tokenizer_path", "assets/tokenizer/tokenizer.model"]


def main() -> int:
    import datasets
    import torch
    import torchao

    print(f"torch {torch.__version__}, torchao {torchao.__version__}, datasets {datasets.__version__}")
    import os

    os.chdir(ROOT)  # the TOML's paths are relative to the kiln checkout, as run.sh runs it
    from torchtitan.config import ConfigManager

    flags = ["--model.converters", "quantize.linear.float8", "--quantize.linear.float8.recipe_name", "rowwise"]
    cfg = ConfigManager().parse_args(["--job.config_file", str(BUNDLE / "llama3_8b_8l.toml"), *flags])
    assert cfg.model.flavor == "8B_8L" and cfg.training.seq_len == 8192 and cfg.compile.enable, cfg
    assert cfg.quantize.linear.float8.recipe_name == "rowwise" and cfg.activation_checkpoint.selective_ac_option == "op"
    print(f"torchtitan config: flavor {cfg.model.flavor}, seq {cfg.training.seq_len}, float8 {flags[-1]}: ok")

    import importlib

    importlib.import_module(cfg.experimental.custom_import)
    from torchtitan.models.llama3 import Transformer as TTTransformer
    from torchtitan.models.llama3 import llama3_args

    tt_args = dataclasses.replace(llama3_args["8B_8L"], max_seq_len=cfg.training.seq_len)
    with torch.device("meta"):
        tt_params = sum(p.numel() for p in TTTransformer(tt_args).parameters())
    from kiln_base.config import parse_args
    from models import Transformer
    from trainer.build import model_args

    kiln_cfg = parse_args(KILN_SHAPE)
    args = model_args(kiln_cfg.model, kiln_cfg.training.seq_len, 2256)
    with torch.device("meta"):
        kiln_params = sum(p.numel() for p in Transformer(args).parameters())
    assert tt_params == kiln_params, f"torchtitan 8B_8L has {tt_params:,} parameters, kiln's preset {kiln_params:,}"
    print(f"same shape: {kiln_params:,} parameters in both ({args.n_layers} layers, vocab {args.vocab_size}): ok")

    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from trainer.components.tokenizer import Tokenizer

    hf = HuggingFaceTokenizer(cfg.model.hf_assets_path)
    kiln = Tokenizer(str(ROOT / "assets" / "tokenizer" / "tokenizer.model"))
    docs = [json.loads(line)["text"] for line in (BUNDLE / "data" / "kiln_corpus.jsonl").open().readlines()[:200]]
    docs.append("Unicode: naïve café — 東京 🙂, numbers 1234567, tabs\tand\nnewlines  ")
    for doc in docs:
        ours, theirs = kiln.encode(doc, bos=False, eos=False), hf.encode(doc, add_bos=False, add_eos=False)
        assert ours == theirs, f"token ids differ on {doc[:60]!r}: kiln {ours[:12]}, tokenizer.json {theirs[:12]}"
    assert (hf.bos_id, hf.eos_id) == (kiln.bos_id, kiln.eos_id), ((hf.bos_id, hf.eos_id), (kiln.bos_id, kiln.eos_id))
    print(f"tokenizer.json = kiln's tokenizer on {len(docs)} documents (bos {hf.bos_id}, eos {hf.eos_id}): ok")

    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

    ds = HuggingFaceTextDataset(
        cfg.training.dataset, cfg.training.dataset_path, hf, seq_len=cfg.training.seq_len, infinite=True
    )
    inputs, labels = next(iter(ds))
    assert inputs["input"].shape == labels.shape == (cfg.training.seq_len,), (inputs["input"].shape, labels.shape)
    where = f"{cfg.training.dataset} from {cfg.training.dataset_path}"
    print(f"torchtitan dataset {where}: a {labels.shape[0]}-token sample: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
