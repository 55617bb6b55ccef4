"""The orchestration: the Engine that steps the scheduler and the executor, its setup, the async front the
server talks to, the snapshot and telemetry it publishes, and one-shot generation. Imports nothing here:
import the module you use (`engine.orchestration.engine`), so importing the package stays light."""
