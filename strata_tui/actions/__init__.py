"""What a person's keys and the command palette do (Controls, the palette's entries), and the app as the screens,
the palette and the shutdown path see it (StrataHost)."""
