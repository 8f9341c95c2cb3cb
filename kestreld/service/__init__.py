"""The daemon around the engine: argv -> Config (`config`), the RPC socket (`server`), the
wire methods (`methods`), the queue and its engine thread (`scheduler`), `status`, and
systemd integration (`systemd`). `main` wires them together."""
