"""Tasks backed by local data files: GSM8K, MATH/DeepScaleR and code problems.

    task:
      name: gsm8k                       # or math, code
      params:
        path: data/gsm8k_train.jsonl    # JSONL or Parquet, one file or a list
        eval_path: data/gsm8k_test.jsonl  # or eval_fraction: 0.1 (held out by data_seed)
        tokenizer_path: ${model.path}   # the chat template comes from this tokenizer

Rows are read with `datasets` (`areal.tasks.data_files`) and turned into questions and
references by the task's format (`areal.tasks.formats`: column names, `fields` mapping);
a row without a usable question or answer stops the load with its file and row named
(`on_bad_row: error`, the default) or is skipped, counted and logged (`skip`). Prompts are
rendered by `areal.tasks.prompting` with the tokenizer's chat template when it has one
(the tokenizer: the one given by `use_tokenizer`, else `tokenizer_path`; neither: the plain
template). Held-out questions are removed from the training rows (`drop_eval_overlap`).

Files are read on first use, not at construction: reward workers construct the task only to
call `reward`. Rewards run in the reward worker's threads: math-verify for gsm8k/math
(`areal.sandbox.math_reward`), the sandboxed test runner for code
(`areal.sandbox.code_reward`), both imported only when a reward is computed.
"""

from __future__ import annotations

import dataclasses
import logging
import random
import threading
from typing import Any
from collections.abc import Iterator, Sequence

from areal.tasks.base import Prompt, RewardOutcome, Task
from areal.tasks.data_files import BadRows, Row, RowError, as_paths, read_rows, split_by_seed
from areal.tasks.formats import CODE, GSM8K, MATH, Example, RowFormat
from areal.tasks.prompting import DEFAULT_PLAIN_TEMPLATE, DEFAULT_TEMPLATE, PromptStyle, render

log = logging.getLogger(__name__)

DEFAULT_EVAL_FRACTION = 0.1
"""Held out of `path` when no `eval_path` is given."""


class DatasetTask(Task):
    """Prompts from data files in `format`; subclasses choose the format and the reward."""

    format: RowFormat

    def __init__(
        self,
        *,
        path: str | Sequence[str] | None = None,
        eval_path: str | Sequence[str] | None = None,
        eval_fraction: float | None = None,
        data_seed: int = 0,
        fields: dict[str, str | None] | None = None,
        on_bad_row: str = "error",
        drop_eval_overlap: bool = True,
        shuffle: bool = True,
        system_prompt: str = "",
        instruction: str | None = None,
        template: str = DEFAULT_TEMPLATE,
        plain_template: str = DEFAULT_PLAIN_TEMPLATE,
        chat_template: bool | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        tokenizer_path: str | None = None,
        stop: Sequence[str] = (),
        cache_dir: str | None = None,
    ) -> None:
        """
        path: training file(s), JSONL or Parquet.
        eval_path: held-out file(s); without it, `eval_fraction` of `path` is held out.
        eval_fraction: share of `path` held out by `data_seed` (default 0.1 without
            eval_path; not allowed with it).
        data_seed: seed of the held-out draw and of the training order.
        fields: role -> column (or dotted path, or null to ignore the role); see formats.py.
        on_bad_row: 'error' stops at the first unusable row (file and row named); 'skip'
            skips it, counts it and logs it.
        drop_eval_overlap: remove training rows whose question is also a held-out question.
        shuffle: training order reshuffled every epoch (else file order).
        system_prompt, instruction, template, plain_template, chat_template,
            chat_template_kwargs: prompt rendering, see prompting.py.
        tokenizer_path: tokenizer whose chat template renders prompts (e.g. ${model.path});
            a tokenizer given by `use_tokenizer` is used when this is null.
        stop: extra stop strings, each a single token of the tokenizer (e.g. '<|im_end|>'
            for a base model prompted with a chat template).
        cache_dir: the `datasets` cache (default: its own, ~/.cache/huggingface/datasets).
        """
        self.paths = as_paths(path, "path")
        self.eval_paths = as_paths(eval_path, "eval_path")
        if not self.paths and not self.eval_paths:
            raise ValueError(
                f"task {self.name!r}: set task.params.path (training file) and/or "
                "task.params.eval_path (held-out file)"
            )
        if self.eval_paths and eval_fraction is not None:
            raise ValueError(
                "task.params.eval_fraction and task.params.eval_path are "
                "exclusive: give a held-out file or a fraction of path, not both"
            )
        if not self.eval_paths:
            eval_fraction = DEFAULT_EVAL_FRACTION if eval_fraction is None else eval_fraction
            if not 0 < eval_fraction < 1:
                raise ValueError(f"task.params.eval_fraction={eval_fraction!r} must be in (0, 1)")
        self.eval_fraction = eval_fraction
        self.fields = dict(fields or {})
        self.format.check_fields(self.fields)
        BadRows(on_bad_row)  # validates the policy now, not at first use
        self.on_bad_row, self.data_seed = on_bad_row, data_seed
        self.drop_eval_overlap, self.shuffle = drop_eval_overlap, shuffle
        self.style = PromptStyle(
            system_prompt=system_prompt,
            instruction=instruction,
            template=template,
            plain_template=plain_template,
            chat_template=chat_template,
            chat_template_kwargs=dict(chat_template_kwargs or {}),
        )
        self.tokenizer_path, self.stop, self.cache_dir = tokenizer_path, list(stop), cache_dir
        self._tokenizer: Any = None
        self._tokenizer_loaded = False
        self._lock = threading.Lock()
        self._train: list[tuple[Row, Example]] | None = None
        self._eval: list[tuple[Row, Example]] = []
        self._eval_prompts: list[Prompt] | None = None
        self.counts: dict[str, int] = {}
        """After loading: data/train_rows, data/eval_rows, data/skipped_rows,
        data/eval_overlap_dropped."""

    # ---- tokenizer ---------------------------------------------------------------------

    def use_tokenizer(self, tokenizer: Any) -> None:
        """The run's tokenizer (called by whoever tokenizes the prompts); its chat template
        renders them unless `tokenizer_path` names another tokenizer."""
        with self._lock:
            if self.tokenizer_path is None:
                self._tokenizer, self._tokenizer_loaded = tokenizer, True
                self._eval_prompts = None  # render again with the template now known

    def use_tools(self, tools: list[dict[str, Any]]) -> None:
        """The environment's tools go to the chat template (`tools=`) of every prompt."""
        with self._lock:
            kwargs = {**self.style.chat_template_kwargs, "tools": list(tools)}
            self.style = dataclasses.replace(self.style, chat_template_kwargs=kwargs)
            self._eval_prompts = None

    def _get_tokenizer(self) -> Any:
        if not self._tokenizer_loaded:
            if self.tokenizer_path is not None:
                from areal.models.tokenizer import load_tokenizer

                self._tokenizer = load_tokenizer(self.tokenizer_path)
            elif self.style.chat_template is not False:
                log.warning(
                    "task %r: no tokenizer known (task.params.tokenizer_path is null): "
                    "prompts use the plain template, not a chat template",
                    self.name,
                )
            self._tokenizer_loaded = True
        return self._tokenizer

    # ---- data --------------------------------------------------------------------------

    def _examples(self, rows: list[Row], what: str) -> list[tuple[Row, Example]]:
        bad = BadRows(self.on_bad_row)
        out = []
        for row in rows:
            try:
                out.append((row, self.format.example(row, self.fields)))
            except RowError as err:
                bad.handle(err)
        bad.log_summary(len(rows), what)
        self.counts["data/skipped_rows"] = self.counts.get("data/skipped_rows", 0) + len(
            bad.skipped
        )
        return out

    def _load(self) -> None:
        if self._train is not None:
            return
        rows = read_rows(self.paths, cache_dir=self.cache_dir)
        train = self._examples(rows, f"{self.name} {', '.join(self.paths)}")
        if self.eval_paths:
            eval_rows = read_rows(self.eval_paths, cache_dir=self.cache_dir)
            held = self._examples(eval_rows, f"{self.name} {', '.join(self.eval_paths)}")
        else:
            assert self.eval_fraction is not None  # set in __init__ when there is no eval_path
            train, held = split_by_seed(train, self.eval_fraction, self.data_seed)
        num_dropped = 0
        if self.drop_eval_overlap and held:
            held_questions = {repr(ex.question) for _, ex in held}
            kept = [(r, ex) for r, ex in train if repr(ex.question) not in held_questions]
            num_dropped, train = len(train) - len(kept), kept
            if num_dropped:
                log.warning(
                    "task %r: dropped %d training rows whose question is held out "
                    "(drop_eval_overlap)",
                    self.name,
                    num_dropped,
                )
        if not held:
            raise ValueError(
                f"task {self.name!r}: no usable held-out rows in "
                f"{', '.join(self.eval_paths or self.paths)}"
            )
        self.counts.update(
            {
                "data/train_rows": len(train),
                "data/eval_rows": len(held),
                "data/eval_overlap_dropped": num_dropped,
            }
        )
        self._eval, self._train = held, train

    def _prompt(self, split: str, row: Row, example: Example) -> Prompt:
        text = render(
            self.style, example, self.format.instructions[example.kind], self._get_tokenizer()
        )
        return Prompt(prompt_id=f"{split}:{row.where}", text=text, reference=example.reference)

    def eval_prompts(self) -> list[Prompt]:
        """The held-out rows in file order (loading and checking all files on first call)."""
        with self._lock:
            self._load()
            if self._eval_prompts is None:
                self._eval_prompts = [self._prompt("eval", r, ex) for r, ex in self._eval]
            return self._eval_prompts

    def train_prompts(self, seed: int) -> Iterator[Prompt]:
        """One epoch of the training rows, shuffled by (data_seed, seed) unless shuffle=false."""
        with self._lock:
            self._load()
            assert self._train is not None  # _load sets it
            train = list(self._train)
        if not self.paths:
            raise ValueError(f"task {self.name!r} has no training file: set task.params.path")
        if self.shuffle:
            random.Random(f"train/{self.data_seed}/{seed}").shuffle(train)
        for row, example in train:
            yield self._prompt("train", row, example)

    def stop_strings(self) -> list[str]:
        return list(self.stop)


class MathTask(DatasetTask):
    """Math word problems checked by math-verify: MATH/DeepScaleR rows (problem, answer or
    a boxed solution)."""

    name = "math"
    format = MATH

    def __init__(self, *, math_timeout_s: float = 5.0, **params: Any) -> None:
        """math_timeout_s: per-check limit of math-verify (over it: verdict 'timeout')."""
        if not math_timeout_s > 0:
            raise ValueError(f"task.params.math_timeout_s={math_timeout_s!r} must be > 0")
        super().__init__(**params)
        self.math_timeout_s = math_timeout_s

    def reward(self, completion: str, reference: Any) -> RewardOutcome:
        """1.0 when the final answer (last \\boxed{}, 'the answer is', last number) equals
        the reference under math-verify."""
        from areal.sandbox.math_reward import math_reward

        return math_reward(completion, reference, timeout_s=self.math_timeout_s)


class GSM8KTask(MathTask):
    """Grade-school word problems: GSM8K rows (question, answer ending in '#### n')."""

    name = "gsm8k"
    format = GSM8K


class CodeTask(DatasetTask):
    """Programming problems run against their tests in the sandbox (APPS/TACO,
    LiveCodeBench, or {'tests': [...], 'fn_name'?} rows)."""

    name = "code"
    format = CODE

    def __init__(
        self,
        *,
        time_limit_s: float = 4.0,
        memory_mb: int = 1024,
        partial_credit: bool = False,
        float_tolerance: float | None = None,
        max_tests: int | None = None,
        **params: Any,
    ) -> None:
        """time_limit_s: per test, unless the problem gives its own. memory_mb: address
        space per test run. partial_credit: reward the fraction of tests passed.
        float_tolerance: numbers in outputs compare within it. max_tests: run only the first
        ones. The whole check must also fit reward.timeout_s."""
        if not time_limit_s > 0 or memory_mb < 1:
            raise ValueError(
                f"task.params: time_limit_s={time_limit_s!r} and "
                f"memory_mb={memory_mb!r} must be > 0"
            )
        super().__init__(**params)
        self.code_options: dict[str, Any] = dict(
            time_limit_s=float(time_limit_s),
            memory_bytes=memory_mb << 20,
            partial_credit=partial_credit,
            float_tolerance=float_tolerance,
            max_tests=max_tests,
        )
        self._code_config: Any = None

    def reward(self, completion: str, reference: Any) -> RewardOutcome:
        """1.0 when the last ```python block passes every test (or the fraction passed)."""
        from areal.sandbox.code_reward import CodeRewardConfig, code_reward

        if self._code_config is None:
            self._code_config = CodeRewardConfig(**self.code_options)
        return code_reward(completion, reference, config=self._code_config)
