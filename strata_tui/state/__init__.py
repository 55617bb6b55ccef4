"""What the app knows, pure Python (no widgets, no I/O): the reducer folds the workers' news into the ViewState
(the engine as telemetry shows it, its history, the expert cache, prefill ETAs), which the widgets read."""
