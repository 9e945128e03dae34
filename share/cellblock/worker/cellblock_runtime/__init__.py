"""cellblock worker runtime: IPython's InteractiveShell driven over the kernel's framed channel.

Modules (each owns one concern):
  framing      length-prefixed JSON frames on fd 3, interrupt-safe writes
  interrupts   SIGINT disposition: ignored while idle, KeyboardInterrupt while user code runs
  streams      sys.stdout/sys.stderr as write-through UTF-8 text streams on fds 1/2
  ipython_boot fast IPython start-up (skips IPython/__init__'s terminal imports until needed)
  shell        the InteractiveShell subclass, its display publisher and display hook
  stdin        input()/getpass() forwarded to the kernel as input_request frames
  children     reaping orphaned zombies without stealing the exit status of live Popen objects
  requests     execute / complete / inspect / is_complete handlers
  main         start-up and the request loop
"""
