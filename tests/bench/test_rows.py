from kvbench.common.rows import significant, transfer_row


def test_a_short_transfer_keeps_its_measured_time():
    row = transfer_row("memcpy", 1 << 20, 4.2e-5)
    assert row["seconds"] == 4.2e-5
    assert row["GB_per_s"] == 25.0  # 1,048,576 B / 42 µs = 24.97 GB/s, three digits


def test_significant_digits_not_decimals():
    assert significant(0.00012346) == 0.0001235
    assert significant(1234.5678) == 1235.0
