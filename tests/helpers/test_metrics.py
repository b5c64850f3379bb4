"""The /metrics reader the tests share reads what they assert on: exact names, label subsets."""

from __future__ import annotations

from tests.helpers.metrics import metric_value

PAGE = """\
# HELP pdserve_router_requests_total Requests.
# TYPE pdserve_router_requests_total counter
pdserve_router_requests_total{disaggregated="yes",status="200"} 3.0
pdserve_router_requests_total{disaggregated="no",status="200"} 2.0
pdserve_router_requests_total{disaggregated="yes",status="503"} 1.0
pdserve_router_requests_created{disaggregated="yes",status="200"} 1.7e+09
# HELP pdserve_router_requests_waiting_for_workers Waiting.
# TYPE pdserve_router_requests_waiting_for_workers gauge
pdserve_router_requests_waiting_for_workers 4.0
# HELP vllm:request_success Finished requests.
# TYPE vllm:request_success counter
vllm:request_success_total{finished_reason="abort",model_name="tiny"} 5.0
"""


def test_sums_the_series_whose_labels_include_the_asked_ones():
    assert metric_value(PAGE, "pdserve_router_requests_total") == 6
    assert metric_value(PAGE, "pdserve_router_requests_total", disaggregated="yes") == 4
    assert metric_value(PAGE, "pdserve_router_requests_total", disaggregated="yes", status="200") == 3
    assert metric_value(PAGE, "vllm:request_success_total", finished_reason="abort") == 5


def test_a_name_is_matched_whole_and_an_absent_series_reads_zero():
    assert metric_value(PAGE, "pdserve_router_requests") == 0  # a prefix of two other names
    assert metric_value(PAGE, "pdserve_router_requests_waiting_for_workers") == 4
    assert metric_value(PAGE, "pdserve_router_requests_total", status="404") == 0
