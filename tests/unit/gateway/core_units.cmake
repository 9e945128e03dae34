# GoogleTest units of the gateway core: router, auth, the config file and environment, date format, HMAC signer, both WebSocket message formats,
# the ZMQ wire format, kernelspec alias resolution, the SQLite and PostgreSQL stores (a server of its own), their writer
# thread and the state directory lock,
# the metrics registry and its Prometheus text rendering, network policies against the ceiling, and the
# lifecycle of a kernel (one phase, one transition per event), the
# order of shell replies behind the IOPub output published before them, the timer that repeats the sweeps, and a ZMQ channel that outlives a failing handler.
add_executable(gateway_core_unit_tests
  ${CMAKE_CURRENT_LIST_DIR}/router_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/auth_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/config_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/time_format_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/crypto_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/jupyter_message_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kernel_lifecycle_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/kernelspec_registry_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/store_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/http_server_failure_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/metrics_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/network_policy_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/reply_order_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/repeating_timer_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/slurm_job_script_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/store_sealing_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/tenant_store_test.cpp
  ${CMAKE_CURRENT_LIST_DIR}/zmq_channel_test.cpp)
target_link_libraries(gateway_core_unit_tests PRIVATE cellblock_gateway_core cellblock_gtest_main)
cellblock_add_gtest(gateway_core_unit_tests TEST_PREFIX "gateway." TIMEOUT 60)
