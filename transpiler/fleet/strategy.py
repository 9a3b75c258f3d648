"""Fluid 1.8's distributed strategies (`...distribute_transpiler.distributed_strategy`):
each sets on its `DistributeTranspilerConfig` what Paddle's sets.

| strategy | `sync_mode` | `runtime_split_send_recv` | `half_async` | `completely_not_async` | `geo_sgd_mode` | trainer mode |
|---|---|---|---|---|---|---|
| `SyncStrategy` | False | True | True | True | | SYNC |
| `AsyncStrategy` | False | True | | | | ASYNC |
| `HalfAsyncStrategy` | False | True | True | | | HALF_ASYNC |
| `GeoStrategy(n)` | False | True | | | True (`geo_sgd_need_push_nums` n) | GEO |

How our runtime trains each (`training_options`): sync as our sync mode (N trainers equal
local training on their batches together), async as our async mode, half-async over the
sync programs (`transpiler.fleet.half_async`), GEO-SGD over the async programs
(`transpiler.fleet.geo`).
"""

from __future__ import annotations

import copy
import os
from typing import Any

from transpiler.config import DistributeTranspilerConfig


class DistributedMode:
    SYNC = 0
    ASYNC = 1
    HALF_ASYNC = 2
    GEO = 3


class TrainerRuntimeConfig:
    """The trainer's communicator settings (Paddle's `FLAGS_communicator_*`); kept for
    scripts that read or set them, not used by our runtime (it has no communicator)."""

    def __init__(self) -> None:
        self.mode: int | None = None
        threads = os.getenv("CPU_NUM", "1")
        self.runtime_configs: dict[str, Any] = {
            "communicator_max_merge_var_num": os.getenv("FLAGS_communicator_max_merge_var_num", threads),
            "communicator_send_queue_size": os.getenv("FLAGS_communicator_send_queue_size", threads),
            "communicator_independent_recv_thread": os.getenv("FLAGS_communicator_independent_recv_thread", "1"),
            "communicator_min_send_grad_num_before_recv": os.getenv(
                "FLAGS_communicator_min_send_grad_num_before_recv", threads),
            "communicator_thread_pool_size": os.getenv("FLAGS_communicator_thread_pool_size", "5"),
            "communicator_send_wait_times": os.getenv("FLAGS_communicator_send_wait_times", "5"),
            "communicator_is_sgd_optimizer": os.getenv("FLAGS_communicator_is_sgd_optimizer", "1"),
        }


class ServerRuntimeConfig:
    def __init__(self) -> None:
        self._rpc_send_thread_num = int(os.getenv("FLAGS_rpc_send_thread_num", "12"))
        self._rpc_get_thread_num = int(os.getenv("FLAGS_rpc_get_thread_num", "12"))
        self._rpc_prefetch_thread_num = int(os.getenv("FLAGS_rpc_prefetch_thread_num", "12"))


class ExecutionStrategy:
    def __init__(self) -> None:
        self.num_threads = int(os.getenv("CPU_NUM", "1"))
        self.use_thread_barrier = False


class BuildStrategy:
    def __init__(self) -> None:
        self.async_mode = False


def _set_from(target: Any, config: Any, kind: type, what: str) -> Any:
    if isinstance(config, kind):
        return config
    if not isinstance(config, dict):
        raise TypeError(f"{what} only accept input type: dict or {kind.__name__}")
    for key, value in config.items():
        if not hasattr(target, key):
            raise ValueError(f"{kind.__name__} doesn't have key: {key}")
        setattr(target, key, value)
    return target


class DistributedStrategy:
    """A strategy's configs; made by `StrategyFactory`."""

    def __init__(self) -> None:
        self._program_config = DistributeTranspilerConfig()
        self._program_config.geo_sgd_need_push_nums = 100
        self._trainer_runtime_config = TrainerRuntimeConfig()
        self._server_runtime_config = ServerRuntimeConfig()
        self._execute_strategy = ExecutionStrategy()
        self._build_strategy = BuildStrategy()

    def _apply(self) -> None:
        self.check_program_config()
        self.check_trainer_runtime_config()
        self.check_server_runtime_config()
        self.check_build_strategy()
        self.check_execute_strategy()

    def get_program_config(self) -> DistributeTranspilerConfig:
        return self._program_config

    def set_program_config(self, config: DistributeTranspilerConfig | dict) -> None:
        if isinstance(config, DistributeTranspilerConfig):
            self._program_config = config
        elif isinstance(config, dict):
            for key, value in config.items():
                if not hasattr(self._program_config, key):
                    raise ValueError(f"DistributeTranspilerConfig doesn't have key: {key}")
                setattr(self._program_config, key, value)
        else:
            raise TypeError("program_config only accept input type: dict or DistributeTranspilerConfig")
        self.check_program_config()

    def get_trainer_runtime_config(self) -> TrainerRuntimeConfig:
        return self._trainer_runtime_config

    def set_trainer_runtime_config(self, config: TrainerRuntimeConfig | dict) -> None:
        if isinstance(config, TrainerRuntimeConfig):
            self._trainer_runtime_config = config
        elif isinstance(config, dict):
            for key, value in config.items():
                if key not in self._trainer_runtime_config.runtime_configs:
                    raise ValueError(f"TrainerRuntimeConfig doesn't have key: {key}")
                self._trainer_runtime_config.runtime_configs[key] = value
        else:
            raise TypeError("trainer_runtime_config only accept input type: dict or TrainerRuntimeConfig")
        self.check_trainer_runtime_config()

    def get_server_runtime_config(self) -> ServerRuntimeConfig:
        return self._server_runtime_config

    def set_server_runtime_config(self, config: ServerRuntimeConfig | dict) -> None:
        self._server_runtime_config = _set_from(self._server_runtime_config, config, ServerRuntimeConfig,
                                                "server_runtime_config")
        self.check_server_runtime_config()

    def get_execute_strategy(self) -> ExecutionStrategy:
        return self._execute_strategy

    def set_execute_strategy(self, config: ExecutionStrategy | dict) -> None:
        self._execute_strategy = _set_from(self._execute_strategy, config, ExecutionStrategy, "execute_strategy")
        self.check_execute_strategy()

    def get_build_strategy(self) -> BuildStrategy:
        return self._build_strategy

    def set_build_strategy(self, config: BuildStrategy | dict) -> None:
        self._build_strategy = _set_from(self._build_strategy, config, BuildStrategy, "build_strategy")
        self.check_build_strategy()

    def check_program_config(self) -> None:
        raise NotImplementedError("use StrategyFactory to create a DistributedStrategy")

    def check_trainer_runtime_config(self) -> None:
        raise NotImplementedError("use StrategyFactory to create a DistributedStrategy")

    def check_server_runtime_config(self) -> None:
        pass

    def check_execute_strategy(self) -> None:
        pass

    def check_build_strategy(self) -> None:
        self._build_strategy.async_mode = True


class SyncStrategy(DistributedStrategy):
    def __init__(self) -> None:
        super().__init__()
        self._apply()

    def check_trainer_runtime_config(self) -> None:
        self._trainer_runtime_config.mode = DistributedMode.SYNC

    def check_program_config(self) -> None:
        config = self._program_config
        config.sync_mode, config.runtime_split_send_recv = False, True
        config.half_async, config.completely_not_async = True, True

    def check_execute_strategy(self) -> None:
        self._execute_strategy.use_thread_barrier = True


class AsyncStrategy(DistributedStrategy):
    def __init__(self) -> None:
        super().__init__()
        self._apply()

    def check_trainer_runtime_config(self) -> None:
        self._trainer_runtime_config.mode = DistributedMode.ASYNC

    def check_program_config(self) -> None:
        self._program_config.sync_mode, self._program_config.runtime_split_send_recv = False, True


class HalfAsyncStrategy(DistributedStrategy):
    def __init__(self) -> None:
        super().__init__()
        self._apply()

    def check_trainer_runtime_config(self) -> None:
        self._trainer_runtime_config.mode = DistributedMode.HALF_ASYNC

    def check_program_config(self) -> None:
        config = self._program_config
        config.sync_mode, config.runtime_split_send_recv, config.half_async = False, True, True

    def check_execute_strategy(self) -> None:
        self._execute_strategy.use_thread_barrier = True


class GeoStrategy(DistributedStrategy):
    def __init__(self, update_frequency: int = 100) -> None:
        super().__init__()
        self._program_config.geo_sgd_need_push_nums = update_frequency
        self._apply()

    def check_program_config(self) -> None:
        config = self._program_config
        config.sync_mode, config.runtime_split_send_recv, config.geo_sgd_mode = False, True, True

    def check_trainer_runtime_config(self) -> None:
        config = self._trainer_runtime_config
        config.mode = DistributedMode.GEO
        config.runtime_configs["communicator_send_queue_size"] = self._program_config.geo_sgd_need_push_nums
        config.runtime_configs["communicator_max_merge_var_num"] = self._program_config.geo_sgd_need_push_nums


class StrategyFactory:
    @staticmethod
    def create_sync_strategy() -> SyncStrategy:
        return SyncStrategy()

    @staticmethod
    def create_half_async_strategy() -> HalfAsyncStrategy:
        return HalfAsyncStrategy()

    @staticmethod
    def create_async_strategy() -> AsyncStrategy:
        return AsyncStrategy()

    @staticmethod
    def create_geo_strategy(update_frequency: int = 100) -> GeoStrategy:
        return GeoStrategy(update_frequency)


def strategy_for(strategy: Any) -> DistributedStrategy:
    """Fluid 1.8's `distributed_optimizer` choice: None → async; a `DistributedStrategy`
    as is; a `DistributeTranspilerConfig` → the strategy its flags name (sync; GEO,
    half-async or async with `runtime_split_send_recv`; half-async without), carrying it."""
    if not strategy:
        return StrategyFactory.create_async_strategy()
    if isinstance(strategy, DistributedStrategy):
        return strategy
    if isinstance(strategy, DistributeTranspilerConfig):
        if strategy.sync_mode:
            chosen: DistributedStrategy = SyncStrategy()
        elif strategy.runtime_split_send_recv:
            if getattr(strategy, "geo_sgd_mode", False):
                chosen = GeoStrategy(getattr(strategy, "geo_sgd_need_push_nums", 100))
            elif strategy.half_async:
                chosen = HalfAsyncStrategy()
            else:
                chosen = AsyncStrategy()
        else:
            chosen = HalfAsyncStrategy()
            strategy.half_async, strategy.runtime_split_send_recv = True, True
        chosen.set_program_config(strategy)
        return chosen
    raise TypeError("strategy must be an instance of DistributeTranspilerConfig, DistributedStrategy")


def geo_update_frequency(strategy: DistributedStrategy) -> int | None:
    """GEO-SGD's `update_frequency` (`geo_sgd_need_push_nums`), None for other strategies."""
    config = strategy.get_program_config()
    if getattr(config, "geo_sgd_mode", False) or isinstance(strategy, GeoStrategy):
        return getattr(config, "geo_sgd_need_push_nums", 100)
    return None


def is_half_async(strategy: DistributedStrategy) -> bool:
    config = strategy.get_program_config()
    if config.completely_not_async or isinstance(strategy, SyncStrategy) or geo_update_frequency(strategy) is not None:
        return False
    return bool(config.half_async) or isinstance(strategy, HalfAsyncStrategy)


def training_options(strategy: DistributedStrategy) -> tuple[bool, DistributeTranspilerConfig]:
    """(sync_mode, the config our transpiler takes): sync and half-async (its pservers
    rewritten by `transpiler.fleet.half_async`) as our sync mode; async, and GEO-SGD
    (`transpiler.fleet.geo`), as our async mode."""
    config = strategy.get_program_config()
    ours = copy.copy(config)
    if geo_update_frequency(strategy) is not None:
        ours.sync_mode, ours.runtime_split_send_recv, ours.half_async, ours.geo_sgd_mode = False, False, False, False
        ours.completely_not_async = False
        return False, ours
    if config.completely_not_async or (isinstance(strategy, SyncStrategy)):
        ours.sync_mode, ours.runtime_split_send_recv, ours.half_async, ours.completely_not_async = True, False, False, False
        return True, ours
    if is_half_async(strategy):  # the sync programs, its pservers rewritten (`transpiler.fleet.half_async`)
        ours.sync_mode, ours.runtime_split_send_recv, ours.half_async, ours.completely_not_async = True, False, False, False
        return True, ours
    if config.sync_mode:
        return True, config
    return False, config


__all__ = [
    "AsyncStrategy",
    "DistributedMode",
    "DistributedStrategy",
    "GeoStrategy",
    "HalfAsyncStrategy",
    "StrategyFactory",
    "SyncStrategy",
    "TrainerRuntimeConfig",
    "geo_update_frequency",
    "is_half_async",
    "strategy_for",
    "training_options",
]
