"""The run directory OUT of one training run: whether training starts fresh, resumes or replaces a run,
what a resume must share with the run it continues, and the checkpoints and best model it saves there;
its metrics, progress and clock are its RunLog's (log.py).

OUT holds a model directory (config.json, model.safetensors, tokenizer) once the run has validated,
plus run.json (the settings a resume must share), train.json, metrics.jsonl, checkpoints/ and,
when asked for, tensorboard/.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import sys
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from aiayn import checkpoint
from aiayn.config import TrainConfig, save_json
from aiayn.data.prepare import Prepared
from aiayn.files import TMP_SUFFIX, atomic_write, check_writable_dir, fsync_dir, remove_temporaries
from aiayn.model import Transformer
from aiayn.tokenizer import JOINT_FILE, SRC_FILE, TGT_FILE, Tokenizer
from aiayn.training.log import METRICS, TENSORBOARD, RunLog

RUN_FILE, DATA = "run.json", "data"
# Where `--force` keeps the run OUT held until the new one has a model: put back if the new run fails
# or is stopped before that, removed once it has one. Not a temporary name: remove_temporaries must
# never take it.
REPLACED = ".replaced-run"
# What makes OUT hold a run (or a model): a new run refuses such a directory without --force.
RUN_FILES = (
    checkpoint.CONFIG, checkpoint.WEIGHTS, checkpoint.TRAIN_CONFIG, checkpoint.CHECKPOINTS, RUN_FILE, METRICS,
    TENSORBOARD, DATA, JOINT_FILE, SRC_FILE, TGT_FILE,
)  # fmt: skip

Mode = Literal["new", "resume", "force"]


@dataclass
class Progress:
    """Where training stands; saved in every checkpoint so a resumed run continues exactly."""

    step: int = 0  # updates done
    epoch: int = 0  # current epoch (0-based)
    batch: int = 0  # next micro-batch of this epoch
    best_bleu: float = -1.0
    bad_validations: int = 0  # validations since the best BLEU
    minutes: float = 0.0  # training time before this process
    best_step: int = -1  # the update whose weights OUT holds as its model; -1: none yet
    validated_step: int = -1  # the last update validated
    metrics_bytes: int = -1  # the length of metrics.jsonl when this was saved; -1: unknown
    # the updates of the checkpoints taken for averaging (§6.1) in the last part of a budget
    averaging: list[int] = dataclasses.field(default_factory=list)


class Run:
    """One training run in OUT. `Run.open` alone decides whether it starts fresh, resumes or replaces
    the run OUT holds; `begin` prepares OUT accordingly once every input has been checked.

    With several ranks (torchrun) every rank has a Run, but only rank 0's (main) writes: the others
    read what they must to resume, and their logging and saving do nothing.

    Over 200 lines for a reason: deciding, beginning, ending and saving are one policy over one
    directory (what --force sets aside is put back by the same object that knows no model was saved
    yet); its clock and metrics are RunLog's, the directory moves module functions.
    """

    def __init__(
        self,
        out: Path,
        start: Literal["fresh", "resume", "replace"],
        progress: bool,
        tensorboard: bool,
        main: bool = True,
        world: int = 1,
    ):
        self.out = out
        self.existed = out.exists()  # else a run that fails its checks removes the directory it made
        self.start = start
        self.main, self.world = main, world
        self.log = RunLog(out, progress, tensorboard, main)  # metrics, progress and the clock
        self.tokenizer: Tokenizer | None = None
        self.scaler: torch.amp.GradScaler | None = None  # fp16: its state goes into every checkpoint
        self.train_config: TrainConfig | None = None
        self.languages: checkpoint.Languages | None = None  # what its models translate (languages.json)
        self.replaced: Path | None = None  # the run OUT held, set aside until this run has a model
        self.restored = False  # this run ended before its first model and put the replaced one back
        self.identity: tuple[int, int] | None = None  # OUT's (device, inode) once begun: see check_out

    # --- Deciding (nothing is written) --------------------------------------------------------------

    @classmethod
    def open(
        cls,
        out: str | Path,
        mode: Mode = "new",
        progress: bool = True,
        tensorboard: bool = False,
        main: bool = True,
        world: int = 1,
    ) -> Run:
        """new: OUT must not hold a run; resume: continue OUT's last checkpoint (a run with none yet
        starts over); force: replace what OUT holds, once the new run's inputs have been checked.
        main, world: this rank is rank 0 of `world` (every rank must open before rank 0 begins)."""
        out = check_writable_dir(out, "run directory")
        if main:
            recover_replaced(out)
        held = [name for name in RUN_FILES if (out / name).exists()]
        has_checkpoint = bool(checkpoint.list_checkpoints(out))
        if mode == "resume" and has_checkpoint:
            for name in (checkpoint.CONFIG, checkpoint.TRAIN_CONFIG):
                if not (checkpoint.list_checkpoints(out)[-1] / name).is_file():
                    raise ValueError(f"{checkpoint.list_checkpoints(out)[-1]}: not a complete checkpoint")
            start = "resume"
        elif mode == "resume":
            if (out / checkpoint.CONFIG).exists():  # a model, but nothing of a run to continue
                raise ValueError(
                    f"{out} holds a model but no checkpoint to resume from: use --force to start over"
                )
            start = "replace" if held else "fresh"  # killed before its first checkpoint: nothing to lose
        elif mode == "force":
            start = "replace" if held else "fresh"
        elif held:
            raise ValueError(
                f"{out} already holds a run ({', '.join(held)}): use --resume to continue it or --force to "
                "start over"
            )
        else:
            start = "fresh"
        return cls(out, start, progress, tensorboard, main, world)

    @property
    def resuming(self) -> bool:
        return self.start == "resume"

    def last_checkpoint(self) -> Path:
        return checkpoint.list_checkpoints(self.out)[-1]

    def saved_tokenizer(self) -> Tokenizer:
        """The tokenizer of the run being resumed."""
        return Tokenizer.load(self.last_checkpoint())

    @property
    def data_dir(self) -> Path:
        """Where a run that prepares its own corpus keeps it: OUT/data."""
        return self.out / DATA

    @contextlib.contextmanager
    def checking(self) -> Iterator[None]:
        """Reading and checking the inputs, before OUT changes: if that fails, what was staged in OUT for
        this run (a corpus prepared, not yet in OUT/data) is removed, and OUT too if this run made it,
        so OUT is left as it was."""
        try:
            yield
        except BaseException:
            if self.main and self.out.is_dir():
                remove_temporaries(self.out)
                if not self.existed and not any(self.out.iterdir()):
                    self.out.rmdir()
            raise

    def staged(self, data: Prepared) -> bool:
        return data.directory.parent == self.out and data.directory.name.endswith(TMP_SUFFIX)

    # --- Beginning (OUT is changed from here on) ----------------------------------------------------

    def begin(
        self,
        settings: dict[str, Any],
        model: Transformer,
        optimizer: torch.optim.Optimizer,
        data: Prepared,
        train_config: TrainConfig,
        scaler: torch.amp.GradScaler | None = None,
        languages: checkpoint.Languages | None = None,
    ) -> Progress:
        """Prepare OUT: a resume checks `settings` against the run's own and loads its last checkpoint
        into model, optimizer and fp16's loss scaler; a replacement sets the old run aside; a corpus
        prepared for this run (staged in OUT) moves to OUT/data. -> Progress.
        languages: what the run's models translate; a resume keeps those of its last checkpoint.

        A replaced run is set aside whole, not removed, until this run has written its first model:
        anything that ends this run before that (an error, a signal) puts it back as it was."""
        self.tokenizer, self.train_config, self.scaler = data.tokenizer, train_config, scaler
        self.languages = languages
        if self.main:
            self.out.mkdir(parents=True, exist_ok=True)
            self.identity = identity(self.out)
        state = Progress()
        if self.resuming:
            last = self.last_checkpoint()
            check_settings(self.out, settings, last, self.world)
            saved = checkpoint.load_state(last)
            self.languages = checkpoint.load_languages(last) or languages  # (none: saved before they were)
            checkpoint.load_weights(model, last / checkpoint.WEIGHTS)
            try:
                optimizer.load_state_dict(saved["optimizer"])
                if scaler is not None and "scaler" in saved:  # the scale it had learned, not 2^16 again
                    scaler.load_state_dict(saved["scaler"])
                progress = saved["progress"]
                for legacy in ("snapshots", "average_from"):  # before `averaging` named the updates
                    progress.pop(legacy, None)
                state = Progress(**progress)
            except (KeyError, TypeError, ValueError, RuntimeError) as e:
                raise ValueError(f"{last / checkpoint.STATE}: does not fit this model ({e})") from None
            if self.main:
                self.log.truncate(state.metrics_bytes)
        elif self.main and self.start == "replace":
            self.replaced = set_aside(self.out)
        if self.main:
            if self.staged(data):
                data.commit(self.data_dir)
            for directory in (self.out, self.out / checkpoint.CHECKPOINTS):
                remove_temporaries(directory)  # what a killed save left behind
            atomic_write(self.out / RUN_FILE, lambda p: p.write_text(json.dumps(settings, indent=1) + "\n"))
            atomic_write(self.out / checkpoint.TRAIN_CONFIG, lambda p: save_json(train_config, p))
        self.log.start(state.minutes)
        if self.resuming:
            self.log.record(
                {"event": "resume", "checkpoint": str(self.last_checkpoint()), **asdict(state)}, echo=True
            )
        return state

    def remove_run(self) -> None:
        """Remove what this run wrote in OUT; its model goes first, so OUT is never half of it."""
        for name in (checkpoint.CONFIG, *RUN_FILES):
            path = self.out / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink(missing_ok=True)

    @property
    def replacing(self) -> bool:
        """Whether the run OUT held is still set aside: this run has no model yet."""
        return self.replaced is not None

    def keep_replacement(self) -> None:
        """This run has its first model: the run it replaced goes."""
        if self.replaced is not None:
            shutil.rmtree(self.replaced)
            self.replaced = None

    def put_back(self) -> None:
        """The replaced run back in OUT as it was, and what this run wrote gone."""
        put_back(self.out)
        self.replaced, self.restored = None, True
        print(f"aiayn: {self.out} holds the run it held before --force again, as it was", file=sys.stderr)

    def __enter__(self) -> Run:
        return self

    def __exit__(self, error_type: type | None, error: BaseException | None, traceback: Any) -> None:
        """Close the log. A run that ends before its first model (an error, a signal) puts back the run
        it replaced; a new run that failed before its first checkpoint removes what it wrote, so that
        the corrected command can start again without --force."""
        self.log.close()
        if not self.main or (self.identity is not None and identity(self.out) != self.identity):
            return  # (an OUT removed under the run took what it held along: nothing to put back)
        if self.replacing:
            self.put_back()
        elif error_type is not None and not self.resuming and not checkpoint.list_checkpoints(self.out):
            self.remove_run()

    def check_out(self) -> None:
        """OUT is still the directory this run began in. Removed or moved away while the run went on, it
        took the run's checkpoints along: a save would make a new OUT holding a checkpoint without its
        history, so the run stops instead."""
        if identity(self.out) != self.identity:
            raise ValueError(
                f"{self.out}: removed or moved away while the run went on, with what it had saved; the run "
                "stops here (start it again with the same command)"
            )

    # --- Saving -------------------------------------------------------------------------------------

    def save_checkpoint(
        self, model: Transformer, optimizer: torch.optim.Optimizer, state: Progress
    ) -> Path | None:
        """OUT/checkpoints/step_N with everything a resume needs; older ones pruned, the best one kept."""
        if not self.main:
            return None
        self.check_out()
        saved = dataclasses.replace(state, minutes=self.log.minutes(), metrics_bytes=self.log.length())
        payload = {"optimizer": optimizer.state_dict(), "progress": asdict(saved), "rng": rng_state()}
        if self.scaler is not None:
            payload["scaler"] = self.scaler.state_dict()
        path = checkpoint.save_checkpoint(
            self.out, state.step, model, self.tokenizer, self.train_config, payload, self.languages
        )
        # never pruned: the best one (OUT's model) and those the end of the run averages
        steps = ([state.best_step] if state.best_step >= 0 else []) + state.averaging
        keep = [checkpoint.checkpoint_path(self.out, step) for step in steps]
        checkpoint.prune_checkpoints(self.out, self.train_config.keep_last, keep=keep)
        return path

    def save_model(self, model: Transformer) -> None:
        """OUT's model directory: the weights to translate with."""
        if not self.main:
            return
        self.check_out()
        checkpoint.save_model(self.out, model, self.tokenizer, self.train_config.search, self.languages)
        self.keep_replacement()


def run_languages(
    data: Prepared, start: checkpoint.Languages | None = None, say: Callable[[str], Any] = print
) -> checkpoint.Languages | None:
    """What a run's models translate: its corpus's direction (the --src-lang and --tgt-lang that named its
    files), with the tag by which the model a fine-tuning run starts from (start) chose that target, if
    it had one. Where the corpus's names are not language codes, start's languages (None without --init),
    and a line saying so."""
    src, tgt = data.src_lang, data.tgt_lang
    if not (checkpoint.is_language_code(src) and checkpoint.is_language_code(tgt)):
        kept = (
            f"the model keeps {start.describe()}" if start is not None else "the model records no languages"
        )
        say(f"aiayn: {src} -> {tgt} are not language codes ({checkpoint.CODE_FORM}): {kept}")
        return start
    tags = {tgt: start.tags[tgt]} if start is not None and tgt in start.tags else {}
    return checkpoint.Languages((src,), (tgt,), tags)


# --- --force: the replaced run set aside until the new one has a model -------------------------------


def identity(directory: Path) -> tuple[int, int] | None:
    """(device, inode) of a directory, the same while it is the same directory; None when it is gone."""
    try:
        st = os.stat(directory)
    except OSError:
        return None
    return (st.st_dev, st.st_ino)


def set_aside(out: Path) -> Path:
    """Move everything OUT holds into OUT/.replaced-run, but the temporaries of the new run (the corpus
    it prepared, staged): -> that directory."""
    aside = out / REPLACED
    aside.mkdir()
    # config.json first: then a config.json in OUT beside the aside is the new run's (recover_replaced)
    paths = sorted(out.iterdir(), key=lambda path: path.name != checkpoint.CONFIG)
    for path in paths:
        if path != aside and not (path.name.startswith(".") and path.name.endswith(TMP_SUFFIX)):
            os.replace(path, aside / path.name)
    fsync_dir(out)
    return aside


def recover_replaced(out: Path) -> None:
    """A run replaced with --force whose replacement was killed: put it back if the replacement never
    wrote a model, else remove it (killed between the model and the removal)."""
    aside = out / REPLACED
    if not aside.is_dir():
        return
    if (out / checkpoint.CONFIG).is_file():
        shutil.rmtree(aside)
    else:
        put_back(out)


def put_back(out: Path) -> None:
    """Everything in OUT but OUT/.replaced-run removed, then what that holds moved back into OUT."""
    aside = out / REPLACED
    for path in list(out.iterdir()):
        if path == aside:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    for path in list(aside.iterdir()):
        os.replace(path, out / path.name)
    aside.rmdir()
    fsync_dir(out)


def check_settings(out: Path, settings: dict[str, Any], last: Path, world: int) -> None:
    """Refuse a resume of the run in `out` (its last checkpoint `last`, `world` ranks now) whose settings
    differ from those the run started with, naming each.

    settings: flat {name: JSON value}; "model.X" and "train.X" name fields of the model and training
    configs, which a run made before run.json existed is checked on from its last checkpoint.
    """
    settings = json.loads(json.dumps(settings))  # as run.json holds them (tuples as lists, ...)
    path = out / RUN_FILE
    if path.is_file():
        saved = json.loads(path.read_text())
    else:
        model = asdict(checkpoint.load_model_config(last))
        train = json.loads((last / checkpoint.TRAIN_CONFIG).read_text())
        saved = {f"model.{k}": v for k, v in model.items()} | {f"train.{k}": v for k, v in train.items()}
    differ = [
        f"{key}: {describe(saved[key])} in {out}, {describe(settings.get(key))} now"
        for key in sorted(saved)
        if key in settings and saved[key] != settings[key]
    ]
    key = "train.micro_batches_per_update"  # ranks x accumulate: any split of the same total resumes
    if key in saved and saved[key] != settings.get(key, saved[key]) and saved[key] % world == 0:
        differ.append(f"with {world} rank(s), --set accumulate={saved[key] // world} resumes it")
    if differ:
        raise ValueError(
            f"cannot resume {out} with other settings than it started with ({'; '.join(differ)}); "
            "use the same ones, or --force to start a new run there"
        )


def describe(value: Any) -> str:
    return "(not set)" if value is None else json.dumps(value, sort_keys=True)


def rng_state() -> dict[str, Any]:
    """The random state training consumes (dropout); data order comes from (seed, epoch) alone."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []
    return {"torch": torch.get_rng_state(), "cuda": cuda}
