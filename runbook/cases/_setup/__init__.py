"""Measurement setups kept apart from their case modules: ``_setup/<case>.py`` holds what a
case's `Case` needs to measure it but a reader does not copy (its inputs at each scale, its
floor), where keeping them in ``runbook/cases/<case>.py`` would bury the code to copy. A setup
imports no case module (its case passes in what it needs): the case imports its setup."""
