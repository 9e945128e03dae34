import pytest

from gateway_harness import Gateway


@pytest.fixture(scope="module")
def gateway():
    """A shared gateway with authentication and a warm pool of one kernel."""
    instance = Gateway()
    yield instance
    instance.stop()


@pytest.fixture
def make_gateway():
    """Factory for gateways with special settings; all are stopped after the test."""
    started = []

    def make(*arguments, **kwargs):
        instance = Gateway(*arguments, **kwargs)
        started.append(instance)
        return instance

    yield make
    for instance in started:
        instance.stop()


@pytest.fixture
def kernel(gateway):
    model = gateway.start_kernel()
    yield model
    gateway.delete(f"/api/kernels/{model['id']}")
