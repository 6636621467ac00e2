"""S3 tier specifics (the shared behaviour is in test_contract.py)."""

from __future__ import annotations

from tests.servers import S3Server


def test_s3_fixture_bucket_roundtrip(s3_server: S3Server, s3_bucket: str) -> None:
    client = s3_server.client()
    client.put_object(Bucket=s3_bucket, Key="a/b", Body=b"xyz")
    assert client.get_object(Bucket=s3_bucket, Key="a/b")["Body"].read() == b"xyz"
    other = s3_server.create_bucket()
    assert client.list_objects_v2(Bucket=other).get("KeyCount") == 0
    s3_server.delete_bucket(other)
