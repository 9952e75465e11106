"""Reliability drivers: chaos, hostile input, subscribers, security, memory soak.

Each driver is a plain module with a command line (``python -m tests.reliability.chaos``,
``... .hostile``, ``... .subscribers``, ``... .soak``) that prints a figures table; the
``test_*.py`` files run the same drivers with short profiles and assert the invariants.
"""
