"""Screens: each composes widgets and decides what to show; the app owns state and I/O."""
