"""GradientMail inside the trainers people use: a callback per trainer, each an optional
extra (``gradientmail[transformers]``, ``gradientmail[lightning]``).

- ``transformers.py``: :class:`GradientMailCallback` for the Hugging Face ``Trainer``;
- ``lightning.py``: :class:`GradientMailCallback` for Lightning (``lightning.pytorch``);
- ``_glue.py``: what both do with one Session (:class:`Glue`: start it on the trainer's
  model with its optimizer, line up at the start barrier, step, sync, close, the progress
  line) and the constructor both share (:class:`GlueCallback`).

Importing this package imports neither trainer (``import gradientmail`` never does);
importing a module whose trainer is not installed raises one :class:`ImportError` line
naming the extra (:func:`missing_extra`). docs/training.md, "The Hugging Face Trainer and
Lightning", has the rules the callbacks follow.
"""

from __future__ import annotations

__all__ = ["missing_extra"]


def missing_extra(module: str, extra: str, exc: ModuleNotFoundError) -> ImportError:
    """The one-line error of ``import gradientmail.integrations.<module>`` when ``exc`` says
    the extra's package is not installed."""
    return ImportError(
        f"gradientmail.integrations.{module} needs {(exc.name or extra).partition('.')[0]}, "
        "which is not installed: "
        f"install gradientmail[{extra}] (pip install '<checkout or wheel>[{extra}]'; "
        "GradientMail is not on PyPI)"
    )
