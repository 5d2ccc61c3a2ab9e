"""Downstream evaluation ([eval]): multiple-choice accuracy of the current weights, scored by the sharded model.

lm-evaluation-harness (`lm-eval`, the `eval` extra) owns the tasks: its TaskManager reads the task files (YAML +
local data), `evaluator.evaluate` builds the requests (one per context and choice), and its task code turns the
log-likelihoods into the metrics the task's file asks for (acc and acc_norm, or acc alone as MMLU's), which kiln
logs as lm-eval reports them. kiln is the language model behind lm-eval's interface (`KilnLM`, a `TemplateLM`:
lm-eval's own tokenization of context and continuation, over kiln's tokenizer), so the numbers are those lm-eval
reports for any other model (docs/evaluation.md says why, and checks it against lm-eval's HF backend).

Scoring (`KilnLM._loglikelihood_tokens`): each request is context + continuation tokens, the last token dropped
(lm-eval's HF backend does the same, left-truncated to the model's context); the label of every position that
predicts a continuation token is that token, the others are ignored (-100). Requests are sorted by length, longest
first, and cut into batches of eval.batch_size rows, each padded to about its longest row, a length the layout can
split (`padded_length`). Batch b goes to data-parallel rank b mod dp: every rank of that
replica (TP, CP, PP) runs the same forward through `score` (the Trainer's eval_logprobs: the validation forward of
the layout, returning each row's summed log-likelihood on every rank of the replica), ranks short of a batch run a
padding batch (FSDP's all-gathers need every rank in every forward), and one all-reduce over the data-parallel ranks
gives every rank every request's log-likelihood (each slot filled by one rank, zeros elsewhere: the sum is exact).
Every rank then runs lm-eval's metrics on the same numbers, so every rank holds the same accuracy.

Cost: about one forward over the requests' tokens (plus padding to the batch's length), no backward, nothing kept.
lm-eval builds a request per choice, so a context is run once per choice.
"""

from __future__ import annotations

import contextlib
import io
import logging
import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from kiln_base.config import Eval
from kiln_base.errors import ConfigError
from trainer.components.tokenizer import Tokenizer

logger = logging.getLogger("kiln")

IGNORE = -100  # cross_entropy's ignore_index: positions that predict no continuation token
MULTIPLE_CHOICE = "multiple_choice"

# score(inputs, labels) -> (rows,) summed log-likelihood of the labels that are not IGNORE, on every rank of the replica
Score = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def is_task_file(spec: str) -> bool:
    """eval.tasks entries naming a YAML file rather than a task."""
    return spec.endswith((".yaml", ".yml"))


@contextlib.contextmanager
def _datasets_offline() -> Iterator[None]:
    """HF datasets' offline mode while the tasks load: local files and the HF datasets cache only, never the hub. Set
    on the module (`datasets.config`, read at each call), not in the environment: training data may stream from the
    hub in the same process."""
    import datasets.config

    before = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = before


def load_tasks(cfg: Eval) -> dict[str, Any]:
    """eval.tasks through lm-eval's TaskManager (eval.include_path first; lm-eval's ~15,000 own task files are indexed
    only when a name is not found there, which takes ~15 s): the loaded tasks by name. A task that does not exist,
    whose data does not load offline, or that is not multiple choice: ConfigError naming it."""
    try:
        from lm_eval.tasks import TaskManager
    except ImportError as e:  # the config check found the package; its import can still fail
        raise ConfigError(f"eval.enable needs lm-eval, which does not import ({e}); pip install -e '.[eval]'") from e
    logging.getLogger("lm_eval").setLevel(logging.ERROR)  # its per-task notices (and tqdm bars) are not kiln's log
    paths = list(cfg.include_path)
    manager = TaskManager(include_path=paths or None, include_defaults=False)
    names = [t for t in cfg.tasks if not is_task_file(t)]
    if any(name not in manager.all_tasks for name in names):
        manager = TaskManager(include_path=paths or None, include_defaults=True)
    for name in names:
        if name not in manager.all_tasks:
            raise ConfigError(
                f"eval.tasks: unknown task '{name}': not a task under eval.include_path ({', '.join(paths) or 'none'}) "
                "nor one of lm-eval's own; name a task there, or give the path of its YAML file"
            )
    tasks: dict[str, Any] = {}
    for spec in cfg.tasks:
        try:
            with _datasets_offline():
                loaded = manager.load([spec])["tasks"]
        except Exception as e:  # lm-eval raises what its loaders raise: name the task and say what it said
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"eval.tasks: task '{spec}' does not load ({first}); its data must be local (or in the HF datasets "
                "cache): kiln loads tasks offline"
            ) from None
        for name, task in loaded.items():
            if task.OUTPUT_TYPE != MULTIPLE_CHOICE:
                raise ConfigError(
                    f"eval.tasks: task '{name}' is {task.OUTPUT_TYPE}; kiln scores multiple_choice tasks only "
                    "(log-likelihood of each choice)"
                )
            _check_documents(name, task, None if cfg.limit == -1 else cfg.limit)
            tasks[name] = task
    return tasks


def _check_documents(name: str, task: Any, limit: int | None) -> None:
    """Every document the evaluation will read through lm-eval's own steps (its text, choices and target, its
    requests, its metrics on placeholder log-likelihoods), so that a bad one is one line naming the task and the
    document now, not lm-eval's traceback at the first evaluation."""
    for doc_id, doc in task.doc_iterator(limit=limit):
        try:
            requests = task.construct_requests(doc=doc, ctx=task.doc_to_text(doc), metadata=(name, doc_id, 1))
            if not requests:
                raise ValueError(f"no choices (doc_to_choice gave {task.doc_to_choice(doc)!r})")
            task.process_results(doc, [(0.0, False)] * len(requests))
        except Exception as e:  # whatever lm-eval or the task's template raises: name the document and say what
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(
                f"eval.tasks: task '{name}' document {doc_id} cannot be scored ({first}); fix that document of the "
                "task's data or its template (a multiple-choice document needs a text, at least one choice and a "
                "target)"
            ) from None


def reported_metrics(results: dict[str, Any]) -> dict[str, float]:
    """The metrics lm-eval reports for one task (`{"acc,none": 0.5, "acc_stderr,none": "N/A", "alias": ...}`), by
    name: whatever the task's metric_list asks for (acc and acc_norm, or acc alone), read from lm-eval's output,
    never assumed; a filter other than lm-eval's "none" keeps its name (acc,strict)."""
    out = {}
    for key, value in results.items():
        metric, _, filtered = key.partition(",")
        if filtered and not metric.endswith("_stderr") and isinstance(value, (int, float)):
            out[metric if filtered == "none" else key] = float(value)
    return out


def padded_length(longest: int, max_len: int, quantum: int, shapes: str) -> int:
    """The length a batch whose longest row is `longest` is padded to, a multiple of `quantum` (the layout's split
    of a sequence: tensor-parallel degree x context-parallel chunks) and at most `max_len` (the training sequence
    length, which the layout can split). `shapes`: "tight", the next multiple of quantum (and of 8 when quantum
    divides 8); "divisors", the smallest divisor of max_len that holds it (a pipeline builds stages per shape: a
    few shapes); "fixed", max_len (a compiled model: one shape, no recompile)."""
    if shapes == "fixed":
        return max_len
    if shapes == "tight":
        step = quantum * max(1, 8 // quantum)
        return min(max_len, -(-longest // step) * step)
    for d in range(quantum, max_len + 1, quantum):
        if max_len % d == 0 and d >= longest:
            return d
    return max_len


@dataclass(frozen=True)
class Layout:
    """What the scoring needs of the layout: this rank's data-parallel rank and degree, their group (None without
    data parallelism), the multiple every padded length must be, and which lengths batches take (padded_length)."""

    dp_rank: int
    dp_degree: int
    dp_group: dist.ProcessGroup | None
    quantum: int
    shapes: str  # tight | divisors (pipeline) | fixed (compiled)


def _lm_class() -> type:
    """KilnLM, built on lm-eval's TemplateLM (imported here: lm-eval is an optional extra, ~3 s to import)."""
    from lm_eval.api.model import TemplateLM

    class KilnLM(TemplateLM):
        """kiln's sharded model behind lm-eval's language-model interface: loglikelihood only (multiple choice).
        lm-eval sees one process (rank 0 of 1) on every rank: the requests are split over the data-parallel ranks
        inside `_loglikelihood_tokens`, and every rank gets every answer."""

        def __init__(
            self, tokenizer: Tokenizer, score: Score, layout: Layout, cfg: Eval, max_len: int, device: torch.device
        ) -> None:
            super().__init__()
            self.tok, self.score, self.layout, self.max_len = tokenizer, score, layout, max_len
            self.batch_size = cfg.batch_size
            self.model_device = device  # (lm-eval's LM has a `device` property of its own)
            self.requests_scored = 0
            self.tokens_scored = 0
            self.scored: list[float] = []  # the log-likelihoods of this evaluation's requests, in order

        @property
        def eot_token_id(self) -> int:
            return self.tok.eos_id

        @property
        def prefix_token_id(self) -> int:  # an empty context is scored after BOS, as training documents start
            return self.tok.bos_id

        def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs: Any) -> list[int]:
            """BOS first (training documents start with it; the exported HF tokenizer adds it the same way),
            unless add_special_tokens is False."""
            return self.tok.encode(string, bos=add_special_tokens is not False, eos=False)

        def loglikelihood(self, requests: list, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
            return super().loglikelihood(requests, disable_tqdm=True)

        def _loglikelihood_tokens(self, requests: list, **kwargs: Any) -> list[tuple[float, bool]]:
            rows = []
            for _, context, continuation in requests:
                whole = (context + continuation)[-(self.max_len + 1) :]
                n = min(len(continuation), len(whole) - 1)
                rows.append((whole[:-1], [IGNORE] * (len(whole) - 1 - n) + whole[len(whole) - n :]))
            lls = self._score_rows(rows)
            # is_greedy is not computed (multiple-choice metrics read the log-likelihood only): False.
            return [(ll, False) for ll in lls]

        def _score_rows(self, rows: list[tuple[list[int], list[int]]]) -> list[float]:
            lay, bs = self.layout, self.batch_size
            order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # longest first: batches of like lengths
            batches = [order[i : i + bs] for i in range(0, len(order), bs)]
            rounds = math.ceil(len(batches) / lay.dp_degree)
            out = torch.zeros(len(rows), dtype=torch.float32, device=self.model_device)
            pad = self.tok.eos_id
            for r in range(rounds):
                b = r * lay.dp_degree + lay.dp_rank
                members = batches[b] if b < len(batches) else []  # past the last batch: a padding batch
                longest = max((len(rows[i][0]) for i in members), default=1)
                length = padded_length(longest, self.max_len, lay.quantum, lay.shapes)
                inputs = torch.full((bs, length), pad, dtype=torch.long)
                labels = torch.full((bs, length), IGNORE, dtype=torch.long)
                for row, i in enumerate(members):
                    tokens, targets = rows[i]
                    inputs[row, : len(tokens)] = torch.tensor(tokens)
                    labels[row, : len(targets)] = torch.tensor(targets)
                scores = self.score(inputs.to(self.model_device), labels.to(self.model_device))
                if members:
                    out[torch.tensor(members, device=self.model_device)] = scores[: len(members)].float()
                    self.tokens_scored += sum(len(rows[i][0]) for i in members)
            if lay.dp_group is not None:
                dist.all_reduce(out, group=lay.dp_group)  # each request scored on one rank, zeros elsewhere
            self.requests_scored += len(rows)
            lls: list[float] = out.tolist()
            self.scored.extend(lls)
            return lls

        def loglikelihood_rolling(self, requests: list, disable_tqdm: bool = False) -> list[float]:
            raise NotImplementedError("kiln scores multiple-choice tasks only")

        def generate_until(self, requests: list, disable_tqdm: bool = False) -> list[str]:
            raise NotImplementedError("kiln scores multiple-choice tasks only")

    return KilnLM


@dataclass(frozen=True)
class EvalResult:
    scores: dict[str, dict[str, float]]  # task -> {"acc": ..., "acc_norm": ... (what lm-eval reports), "examples": n}
    seconds: float
    requests: int  # (context, choice) pairs scored
    tokens: int  # tokens forwarded by this data-parallel rank (without padding)

    def line(self, step: int) -> str:
        tasks = "  ".join(
            f"{name}: " + "".join(f"{m} {v:.4f}  " for m, v in self.metrics(name).items()) + f"(n={int(s['examples'])})"
            for name, s in self.scores.items()
        )
        return f"eval step: {step:2}  {tasks}  time: {self.seconds:.1f}s"

    def metrics(self, task: str) -> dict[str, float]:
        """The task's metrics as lm-eval reported them (without the example count)."""
        return {m: v for m, v in self.scores[task].items() if m != "examples"}


class DownstreamEval:
    """The loaded tasks and kiln's model behind lm-eval's interface; `run(step)` scores them all with the current
    weights (a collective: every rank calls it at the same steps)."""

    def __init__(
        self, cfg: Eval, tasks: dict[str, Any], tokenizer: Tokenizer, score: Score, layout: Layout, max_len: int,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.cfg, self.tasks = cfg, tasks
        self.lm = _lm_class()(tokenizer, score, layout, cfg, max_len, device)
        self.results: dict[int, EvalResult] = {}  # step -> result, for tests and callers
        self.log_likelihoods: dict[int, list[float]] = {}  # step -> every request's, in lm-eval's order
        self.samples: dict[str, list[dict[str, Any]]] = {}  # the last run's per-example records (lm-eval's)

    def run(self, step: int, log_samples: bool = False) -> EvalResult:
        from lm_eval.evaluator import evaluate

        t0 = time.perf_counter()
        requests0, tokens0 = self.lm.requests_scored, self.lm.tokens_scored
        self.lm.scored = []
        limit = None if self.cfg.limit == -1 else self.cfg.limit
        # lm-eval's progress bars (tqdm, unconditional where it builds requests) are not kiln's output: dropped.
        with torch.no_grad(), contextlib.redirect_stderr(io.StringIO()):
            out = evaluate(
                lm=self.lm,
                task_dict={"tasks": self.tasks, "groups": {}},
                limit=limit,
                bootstrap_iters=0,
                log_samples=log_samples,
            )
        assert out is not None, "lm-eval sees rank 0 of 1 on every rank"
        scores = {}
        for name in self.tasks:
            r = out["results"][name]
            examples = float(out["n-samples"][name]["effective"])
            scores[name] = reported_metrics(r) | {"examples": examples}
        self.samples = out.get("samples") or {}
        result = EvalResult(
            scores, time.perf_counter() - t0, self.lm.requests_scored - requests0, self.lm.tokens_scored - tokens0
        )
        self.results[step] = result
        self.log_likelihoods[step] = self.lm.scored
        return result


def build_downstream_eval(
    cfg: Eval, tokenizer: Tokenizer, score: Score, layout: Layout, max_len: int, device: torch.device
) -> DownstreamEval:
    """The tasks loaded (every failure a one-line ConfigError, before the first step) and the evaluator over them."""
    tasks = load_tasks(cfg)
    logger.info(
        f"Eval: {', '.join(tasks)} (lm-eval), every {cfg.freq} steps, at step 1 and at the last step; "
        f"{'all' if cfg.limit == -1 else cfg.limit} examples per task, {cfg.batch_size} sequences per forward"
    )
    return DownstreamEval(cfg, tasks, tokenizer, score, layout, max_len, device)
