"""Widgets of the monitor and profiles screens. A widget knows no screen: data comes in through its
methods and attributes, user intent goes out as messages."""
