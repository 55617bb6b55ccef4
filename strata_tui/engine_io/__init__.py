"""Everything that talks to the world outside the app: the engine process (launch, stop, the reaper), its HTTP
API and event stream, other engines' servers, NVML and the host's /proc; the worker bodies that run it and the
messages they post."""
