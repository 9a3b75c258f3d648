"""The unit every pass takes and returns: the programs being built plus what earlier
passes learned (the analysis of the original program and the partition plan)."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from transpiler.ir import CloneMap, Op, Program
from transpiler.naming import control_var
from transpiler.plan import Plan


@dataclass
class ParamChain:
    """One parameter's update: the ops that leave the trainer for its pservers.

    Ops are the original program's (global block); a pass working on a clone finds
    their copies through the clone's map. `ops` holds every optimize-role op tied to the
    param (L2-decay `scale`/`sum`, ...; gradient clips stay on the trainer) and the optimizer
    op itself, in program order.
    """

    param: str
    grad: str  # the grad the trainer sends: what backward (or the trainer's clip) wrote, before decay
    optimizer: Op
    ops: list[Op]
    grad_producer: Op  # the last op the trainer keeps that writes `grad`
    sparse: bool = False  # the grad is SELECTED_ROWS (an is_sparse embedding table)


@dataclass
class TableLookups:
    """The `lookup_table` ops reading one embedding table."""

    table: str
    lookups: list[Op]  # in program order
    op_type: str  # lookup_table or lookup_table_v2
    distributed: bool  # is_distributed: rows live only on the pservers, sharded id % #pservers
    remote_prefetch: bool  # rows are fetched from the table's blocks instead of receiving the table
    padding_idx: int


@dataclass
class Analysis:
    """What find_optimize learnt about the original program; its ops, never positions."""

    chains: list[ParamChain]
    optimize_ops: list[Op]  # every op that leaves the trainer for the optimize blocks
    lr_ops: list[Op]  # ops computing the learning rate, in order
    lr_counter: str | None = None  # the global step var the lr ops update, if any
    lr_counter_update: Op | None = None  # the op that updates it (`increment`, or the lowered `sum`)
    tables: dict[str, TableLookups] = field(default_factory=dict)  # sparse / distributed embedding tables
    distributed_table: ParamChain | None = None  # the is_distributed table (at most one), not in `chains`
    # The analysed original, held so that its ops keep their block: an op holds its block
    # weakly (transpiler/ir/program.py), and an analysis may outlive the bundle it came in.
    program: Program | None = field(default=None, repr=False, compare=False)

    def to_text(self) -> str:
        """A stable text form for `--dump-dir` (`analysis.txt`): one line per finding,
        ops as `index:type`, the index their position in the (frozen) original."""

        def op(found: Op | None) -> str:
            return "none" if found is None else f"{found.index}:{found.type}"

        def chain(kind: str, c: ParamChain) -> str:
            return (f"{kind} {c.param} grad={c.grad} optimizer={op(c.optimizer)} grad_producer={op(c.grad_producer)} "
                    f"ops=[{', '.join(op(i) for i in c.ops)}]{' sparse' if c.sparse else ''}")

        lines = ["# ps-transpiler analysis v1",
                 f"optimize_ops [{', '.join(op(i) for i in self.optimize_ops)}]",
                 f"lr_ops [{', '.join(op(i) for i in self.lr_ops)}]",
                 f"lr_counter {self.lr_counter} updated_by={op(self.lr_counter_update)}"
                 if self.lr_counter is not None else "lr_counter none"]
        lines += [chain("param", c) for c in self.chains]
        for name, t in self.tables.items():
            flags = "".join(f" {flag}" for flag, on in (("distributed", t.distributed),
                                                         ("remote_prefetch", t.remote_prefetch)) if on)
            lines.append(f"table {name} {t.op_type} lookups=[{', '.join(op(i) for i in t.lookups)}] "
                         f"padding_idx={t.padding_idx}{flags}")
        if self.distributed_table is not None:
            lines.append(chain("distributed_table", self.distributed_table))
        return "\n".join(lines) + "\n"


@dataclass
class TrainerSends:
    """What insert_sends left for insert_recvs: each param's `send` control var (an async
    `recv` waits on it) and the `send_barrier`'s (a sync `recv` waits on that)."""

    control: dict[str, str] = field(default_factory=dict)  # param -> the control var its send writes
    barrier: str | None = None


@dataclass
class PserverPrograms:
    """One pserver's programs, and what the pserver passes that build block 0's
    `listen_and_serv` collect for it on the way."""

    main: Program
    startup: Program | None = None
    # Original var name -> (pserver var, block index) standing for it here (a param's
    # blocks, an accumulator cut like its param, ...): what the startup pass initialises.
    # An ordered set (dict keys): membership must not cost a scan, there is one per trainer.
    instances: dict[str, dict[tuple[str, int], None]] = field(default_factory=dict)
    lr_block: int = -1  # the lr-decay block, -1 when there is none
    optimize_blocks: list[int] = field(default_factory=list)
    received: list[str] = field(default_factory=list)  # the grads `listen_and_serv` takes (its X)
    grad_to_block: list[tuple[str, int]] = field(default_factory=list)
    sparse_grad_to_param: list[tuple[str, str]] = field(default_factory=list)
    table_attrs: dict = field(default_factory=dict)  # the distributed table's blocks, as listen_and_serv attrs

    @property
    def optimize_parent(self) -> int:
        """Optimize blocks are children of the lr block, which then runs first (Paddle makes
        them children of its last sub-block, an artefact of how it counted blocks)."""
        return self.lr_block if self.lr_block >= 0 else 0


@dataclass(frozen=True)
class NormGroup:
    """A global-norm gradient clip moved to the pservers (`clip_mode="exact"`): the grads
    it scales by `clip_norm / max(clip_norm, |all grads|)`, as (param, grad) pairs, and
    the grads' dtype. transpiler/passes/pserver_norm_reduce.py builds its reduction."""

    clip_norm: float
    grads: tuple[tuple[str, str], ...]


@dataclass
class Bundle:
    """Programs under construction. `origin` / `origin_startup` are the user's programs as
    the passes see them: private copies, which lowerings rewrite and find_optimize analyses
    and freezes, or (`lent`, from `transpile()`) the caller's own, which no pass changes:
    a lowering that rewrites them takes copies first (`own_origins`), and they are not
    frozen (that would change them; the pass tests run on frozen copies)."""

    origin: Program
    origin_startup: Program
    trainer: Program | None = None
    trainer_ops: CloneMap | None = None  # origin -> trainer: where the analysed ops are in the trainer
    trainer_sends: TrainerSends | None = None
    trainer_startup: Program | None = None
    pservers: dict[str, PserverPrograms] = field(default_factory=dict)
    analysis: Analysis | None = None
    plan: Plan | None = None
    control_vars: int = 0
    lowered_lr_counter: str | None = None  # the step counter the async lr-decay lowering split per trainer
    lent: bool = False  # origin / origin_startup are the caller's programs, not copies
    norm_groups: tuple[NormGroup, ...] = ()  # global-norm clips the pservers compute (clip_mode="exact")

    def own_origins(self) -> Bundle:
        """This bundle with copies of lent originals, for a pass about to rewrite them
        (copying only then spares every other transpile two whole-program clones)."""
        if not self.lent:
            return self
        return replace(self, origin=self.origin.clone(), origin_startup=self.origin_startup.clone(), lent=False)

    def new_control_var(self, program: Program) -> str:
        """A fresh dependency-only var, `__control_var@<n>` (Paddle uses random numbers;
        these count up so every process names them alike)."""
        while True:
            name = control_var(self.control_vars)
            self.control_vars += 1
            if not program.global_block().has_var(name):
                break
        from transpiler.ir.types import VarKind

        program.global_block().create_var(name, VarKind.RAW)
        return name

    def programs(self) -> list[tuple[str, Program]]:
        """(name, program) for every program built so far, in a stable order."""
        out: list[tuple[str, Program]] = []
        if self.trainer is not None:
            out.append(("trainer", self.trainer))
        if self.trainer_startup is not None:
            out.append(("trainer_startup", self.trainer_startup))
        for endpoint, progs in self.pservers.items():
            out.append((f"pserver_{endpoint}", progs.main))
            if progs.startup is not None:
                out.append((f"pserver_{endpoint}_startup", progs.startup))
        return out
