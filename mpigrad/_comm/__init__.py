"""The MPI side below the engine: the watched communicator, the watchdog and peer
notices, ULFM (lost ranks), and the structure check's fingerprints."""
