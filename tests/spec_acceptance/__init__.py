"""Spec 004's acceptance snippets ("Using it in a run"), run unchanged as real processes.

- ``train.py``: one training process of the "two processes" run, the snippet as printed;
- ``align.py``: the third process, ``gm.align(model, mailbox=box)``;
- ``common.py``: what the snippets take as given: ``model``, ``optimizer``, ``dataloader``,
  ``train_step``, defined around them.

``tests/spec_acceptance/test_spec_acceptance.py`` starts them. The mailbox class is the one
the spec prints, ``tests/thirdparty/spec_file_mailbox.py``.
"""
