"""Running transpiled programs: the one layer that imports both the transpiler API and
the executor / `ops.rpc`.

| module | what |
|---|---|
| `role` | who this process is in a job, read from Paddle's environment variables |
| `session` | `Session`: one process's part of a training job, for any role |
| `launch` | `launch`: M pservers and N trainers of one script on this machine |
| `progress` | the progress line trainers print and `launch` reads |
| `script` | `run_script`: a training script that fails exits 1 with one line, not a traceback |

The package imports nothing itself, so `launch` does not pay for the executor.
"""
