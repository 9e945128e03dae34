# GoogleTest units of the agent API (gateway/src/agent): output shielding, limits, the execution collector, file
# path checks, session names, the live page's event log, the answer renderer, the execute queue, the kernel
# binding. No kernel process, no sockets.
add_executable(gateway_agent_unit_tests
  agent_output_shield_test.cpp
  agent_limits_test.cpp
  agent_execution_test.cpp
  agent_paths_test.cpp
  agent_live_events_test.cpp
  agent_answer_renderer_test.cpp
  agent_execute_queue_test.cpp
  agent_kernel_binding_test.cpp)
target_link_libraries(gateway_agent_unit_tests PRIVATE cellblock_gateway_agent cellblock_gtest_main)
cellblock_add_gtest(gateway_agent_unit_tests)
