"""PostgreSQL type catalog facts that the value codecs need.

A codec is chosen from a column's type OID. Built-in types (OIDs below 16384,
fixed across PostgreSQL versions) come from :data:`BUILTIN_TYPES`, generated
once from a PostgreSQL 15 ``pg_type``::

    SELECT oid, typname, typtype, typcategory, typelem, typbasetype, typtypmod, typdelim
    FROM pg_type
    WHERE oid < 16384 AND typtype IN ('b','r','m','d','e','c')
      AND typnamespace = 'pg_catalog'::regnamespace

plus ``cstring`` (a pseudo-type, oid 2275), because the built-in ``_cstring``
array names it as its element.

Types created later (extensions such as citext, enums, domains, composites,
user ranges, and their array types) have OIDs that differ per database; they
are looked up from the server (:class:`cdcd.source.catalog.PgCatalog`) or
given explicitly (:class:`StaticCatalog`, for tests).

Quirks worth knowing:

* ``typelem`` is not only set on arrays: ``name`` (element ``char``),
  ``point`` and ``lseg`` are subscriptable fixed-length types with a
  ``typelem`` but are not arrays. An array is ``typcategory = 'A'``; of those,
  ``int2vector`` and ``oidvector`` have a space-separated text form of their
  own and are not treated as arrays.
* ``typdelim`` is ``;`` for ``box`` only: arrays of boxes separate elements
  with ``;`` because a box's text form contains commas. The delimiter of an
  array is its *element* type's ``typdelim``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

__all__ = ["BUILTIN_TYPES", "PgType", "StaticCatalog", "TypeCatalog"]


@dataclass(frozen=True, slots=True)
class PgType:
    """Catalog facts for one type OID (a row of ``pg_type``)."""

    oid: int
    namespace: str
    name: str
    kind: str  # typtype: b base, d domain, e enum, c composite, r range, m multirange, p pseudo
    category: str  # typcategory: 'A' array, 'N' numeric, 'S' string, 'D' datetime, 'U' user...
    element_oid: int  # typelem of array types (0 if none)
    base_oid: int  # typbasetype of domains (0 if none)
    base_modifier: int  # typtypmod of domains (-1 if none)
    delimiter: str  # typdelim: ',' for every built-in type except box (';')

    @property
    def is_array(self) -> bool:
        """True for real array types (``_int4`` ...), false for int2vector/oidvector/point."""
        return (
            self.category == "A"
            and self.element_oid != 0
            and self.kind == "b"
            and self.oid not in _VECTOR_OIDS
        )


#: int2vector and oidvector: category 'A' but text form "1 2 3", not "{1,2,3}".
_VECTOR_OIDS = frozenset({22, 30})


class TypeCatalog(Protocol):
    """Where codecs learn about type OIDs."""

    def lookup(self, oid: int) -> PgType:
        """The facts for ``oid``; raises KeyError if the type is unknown."""
        ...


# One entry per type: "oid name <typtype><typcategory> typelem [typdelim]"; typdelim is
# given only when it is not ",". No built-in pg_catalog type is a domain, so typbasetype
# is always 0 and typtypmod -1 here.
_TABLE = """
16 bool bB 0 | 17 bytea bU 0 | 18 char bZ 0 | 19 name bS 18 | 20 int8 bN 0 | 21 int2 bN 0 |
22 int2vector bA 21 | 23 int4 bN 0 | 24 regproc bN 0 | 25 text bS 0 | 26 oid bN 0 |
27 tid bU 0 | 28 xid bU 0 | 29 cid bU 0 | 30 oidvector bA 26 | 71 pg_type cC 0 |
75 pg_attribute cC 0 | 81 pg_proc cC 0 | 83 pg_class cC 0 | 114 json bU 0 | 142 xml bU 0 |
143 _xml bA 142 | 194 pg_node_tree bZ 0 | 199 _json bA 114 | 210 _pg_type bA 71 |
270 _pg_attribute bA 75 | 271 _xid8 bA 5069 | 272 _pg_proc bA 81 | 273 _pg_class bA 83 |
600 point bG 701 | 601 lseg bG 600 | 602 path bG 0 | 603 box bG 600 ; | 604 polygon bG 0 |
628 line bG 701 | 629 _line bA 628 | 650 cidr bI 0 | 651 _cidr bA 650 | 700 float4 bN 0 |
701 float8 bN 0 | 718 circle bG 0 | 719 _circle bA 718 | 774 macaddr8 bU 0 |
775 _macaddr8 bA 774 | 790 money bN 0 | 791 _money bA 790 | 829 macaddr bU 0 |
869 inet bI 0 | 1000 _bool bA 16 | 1001 _bytea bA 17 | 1002 _char bA 18 |
1003 _name bA 19 | 1005 _int2 bA 21 | 1006 _int2vector bA 22 | 1007 _int4 bA 23 |
1008 _regproc bA 24 | 1009 _text bA 25 | 1010 _tid bA 27 | 1011 _xid bA 28 |
1012 _cid bA 29 | 1013 _oidvector bA 30 | 1014 _bpchar bA 1042 | 1015 _varchar bA 1043 |
1016 _int8 bA 20 | 1017 _point bA 600 | 1018 _lseg bA 601 | 1019 _path bA 602 |
1020 _box bA 603 ; | 1021 _float4 bA 700 | 1022 _float8 bA 701 | 1027 _polygon bA 604 |
1028 _oid bA 26 | 1033 aclitem bU 0 | 1034 _aclitem bA 1033 | 1040 _macaddr bA 829 |
1041 _inet bA 869 | 1042 bpchar bS 0 | 1043 varchar bS 0 | 1082 date bD 0 |
1083 time bD 0 | 1114 timestamp bD 0 | 1115 _timestamp bA 1114 | 1182 _date bA 1082 |
1183 _time bA 1083 | 1184 timestamptz bD 0 | 1185 _timestamptz bA 1184 |
1186 interval bT 0 | 1187 _interval bA 1186 | 1231 _numeric bA 1700 |
1248 pg_database cC 0 | 1263 _cstring bA 2275 | 1266 timetz bD 0 | 1270 _timetz bA 1266 |
1560 bit bV 0 | 1561 _bit bA 1560 | 1562 varbit bV 0 | 1563 _varbit bA 1562 |
1700 numeric bN 0 | 1790 refcursor bU 0 | 2201 _refcursor bA 1790 |
2202 regprocedure bN 0 | 2203 regoper bN 0 | 2204 regoperator bN 0 | 2205 regclass bN 0 |
2206 regtype bN 0 | 2207 _regprocedure bA 2202 | 2208 _regoper bA 2203 |
2209 _regoperator bA 2204 | 2210 _regclass bA 2205 | 2211 _regtype bA 2206 |
2842 pg_authid cC 0 | 2843 pg_auth_members cC 0 | 2949 _txid_snapshot bA 2970 |
2950 uuid bU 0 | 2951 _uuid bA 2950 | 2970 txid_snapshot bU 0 | 3220 pg_lsn bU 0 |
3221 _pg_lsn bA 3220 | 3361 pg_ndistinct bZ 0 | 3402 pg_dependencies bZ 0 |
3614 tsvector bU 0 | 3615 tsquery bU 0 | 3642 gtsvector bU 0 | 3643 _tsvector bA 3614 |
3644 _gtsvector bA 3642 | 3645 _tsquery bA 3615 | 3734 regconfig bN 0 |
3735 _regconfig bA 3734 | 3769 regdictionary bN 0 | 3770 _regdictionary bA 3769 |
3802 jsonb bU 0 | 3807 _jsonb bA 3802 | 3904 int4range rR 0 | 3905 _int4range bA 3904 |
3906 numrange rR 0 | 3907 _numrange bA 3906 | 3908 tsrange rR 0 | 3909 _tsrange bA 3908 |
3910 tstzrange rR 0 | 3911 _tstzrange bA 3910 | 3912 daterange rR 0 |
3913 _daterange bA 3912 | 3926 int8range rR 0 | 3927 _int8range bA 3926 |
4066 pg_shseclabel cC 0 | 4072 jsonpath bU 0 | 4073 _jsonpath bA 4072 |
4089 regnamespace bN 0 | 4090 _regnamespace bA 4089 | 4096 regrole bN 0 |
4097 _regrole bA 4096 | 4191 regcollation bN 0 | 4192 _regcollation bA 4191 |
4451 int4multirange mR 0 | 4532 nummultirange mR 0 | 4533 tsmultirange mR 0 |
4534 tstzmultirange mR 0 | 4535 datemultirange mR 0 | 4536 int8multirange mR 0 |
4600 pg_brin_bloom_summary bZ 0 | 4601 pg_brin_minmax_multi_summary bZ 0 |
5017 pg_mcv_list bZ 0 | 5038 pg_snapshot bU 0 | 5039 _pg_snapshot bA 5038 |
5069 xid8 bU 0 | 6101 pg_subscription cC 0 | 6150 _int4multirange bA 4451 |
6151 _nummultirange bA 4532 | 6152 _tsmultirange bA 4533 | 6153 _tstzmultirange bA 4534 |
6155 _datemultirange bA 4535 | 6157 _int8multirange bA 4536 | 10000 _pg_attrdef bA 10001 |
10001 pg_attrdef cC 0 | 10002 _pg_constraint bA 10003 | 10003 pg_constraint cC 0 |
10004 _pg_inherits bA 10005 | 10005 pg_inherits cC 0 | 10006 _pg_index bA 10007 |
10007 pg_index cC 0 | 10008 _pg_operator bA 10009 | 10009 pg_operator cC 0 |
10010 _pg_opfamily bA 10011 | 10011 pg_opfamily cC 0 | 10012 _pg_opclass bA 10013 |
10013 pg_opclass cC 0 | 10014 _pg_am bA 10015 | 10015 pg_am cC 0 |
10016 _pg_amop bA 10017 | 10017 pg_amop cC 0 | 10018 _pg_amproc bA 10019 |
10019 pg_amproc cC 0 | 10020 _pg_language bA 10021 | 10021 pg_language cC 0 |
10022 _pg_largeobject_metadata bA 10023 | 10023 pg_largeobject_metadata cC 0 |
10024 _pg_largeobject bA 10025 | 10025 pg_largeobject cC 0 | 10026 _pg_aggregate bA 10027 |
10027 pg_aggregate cC 0 | 10028 _pg_statistic bA 10029 | 10029 pg_statistic cC 0 |
10030 _pg_statistic_ext bA 10031 | 10031 pg_statistic_ext cC 0 |
10032 _pg_statistic_ext_data bA 10033 | 10033 pg_statistic_ext_data cC 0 |
10034 _pg_rewrite bA 10035 | 10035 pg_rewrite cC 0 | 10036 _pg_trigger bA 10037 |
10037 pg_trigger cC 0 | 10038 _pg_event_trigger bA 10039 | 10039 pg_event_trigger cC 0 |
10040 _pg_description bA 10041 | 10041 pg_description cC 0 | 10042 _pg_cast bA 10043 |
10043 pg_cast cC 0 | 10044 _pg_enum bA 10045 | 10045 pg_enum cC 0 |
10046 _pg_namespace bA 10047 | 10047 pg_namespace cC 0 | 10048 _pg_conversion bA 10049 |
10049 pg_conversion cC 0 | 10050 _pg_depend bA 10051 | 10051 pg_depend cC 0 |
10052 _pg_database bA 1248 | 10053 _pg_db_role_setting bA 10054 |
10054 pg_db_role_setting cC 0 | 10055 _pg_tablespace bA 10056 | 10056 pg_tablespace cC 0 |
10057 _pg_authid bA 2842 | 10058 _pg_auth_members bA 2843 | 10059 _pg_shdepend bA 10060 |
10060 pg_shdepend cC 0 | 10061 _pg_shdescription bA 10062 | 10062 pg_shdescription cC 0 |
10063 _pg_ts_config bA 10064 | 10064 pg_ts_config cC 0 | 10065 _pg_ts_config_map bA 10066 |
10066 pg_ts_config_map cC 0 | 10067 _pg_ts_dict bA 10068 | 10068 pg_ts_dict cC 0 |
10069 _pg_ts_parser bA 10070 | 10070 pg_ts_parser cC 0 | 10071 _pg_ts_template bA 10072 |
10072 pg_ts_template cC 0 | 10073 _pg_extension bA 10074 | 10074 pg_extension cC 0 |
10075 _pg_foreign_data_wrapper bA 10076 | 10076 pg_foreign_data_wrapper cC 0 |
10077 _pg_foreign_server bA 10078 | 10078 pg_foreign_server cC 0 |
10079 _pg_user_mapping bA 10080 | 10080 pg_user_mapping cC 0 |
10081 _pg_foreign_table bA 10082 | 10082 pg_foreign_table cC 0 |
10083 _pg_policy bA 10084 | 10084 pg_policy cC 0 | 10085 _pg_replication_origin bA 10086 |
10086 pg_replication_origin cC 0 | 10087 _pg_default_acl bA 10088 |
10088 pg_default_acl cC 0 | 10089 _pg_init_privs bA 10090 | 10090 pg_init_privs cC 0 |
10091 _pg_seclabel bA 10092 | 10092 pg_seclabel cC 0 | 10093 _pg_shseclabel bA 4066 |
10094 _pg_collation bA 10095 | 10095 pg_collation cC 0 | 10096 _pg_parameter_acl bA 10097 |
10097 pg_parameter_acl cC 0 | 10098 _pg_partitioned_table bA 10099 |
10099 pg_partitioned_table cC 0 | 10100 _pg_range bA 10101 | 10101 pg_range cC 0 |
10102 _pg_transform bA 10103 | 10103 pg_transform cC 0 | 10104 _pg_sequence bA 10105 |
10105 pg_sequence cC 0 | 10106 _pg_publication bA 10107 | 10107 pg_publication cC 0 |
10108 _pg_publication_namespace bA 10109 | 10109 pg_publication_namespace cC 0 |
10110 _pg_publication_rel bA 10111 | 10111 pg_publication_rel cC 0 |
10112 _pg_subscription bA 6101 | 10113 _pg_subscription_rel bA 10114 |
10114 pg_subscription_rel cC 0 | 12001 _pg_roles bA 12002 | 12002 pg_roles cC 0 |
12006 _pg_shadow bA 12007 | 12007 pg_shadow cC 0 | 12011 _pg_group bA 12012 |
12012 pg_group cC 0 | 12015 _pg_user bA 12016 | 12016 pg_user cC 0 |
12019 _pg_policies bA 12020 | 12020 pg_policies cC 0 | 12024 _pg_rules bA 12025 |
12025 pg_rules cC 0 | 12029 _pg_views bA 12030 | 12030 pg_views cC 0 |
12034 _pg_tables bA 12035 | 12035 pg_tables cC 0 | 12039 _pg_matviews bA 12040 |
12040 pg_matviews cC 0 | 12044 _pg_indexes bA 12045 | 12045 pg_indexes cC 0 |
12049 _pg_sequences bA 12050 | 12050 pg_sequences cC 0 | 12054 _pg_stats bA 12055 |
12055 pg_stats cC 0 | 12059 _pg_stats_ext bA 12060 | 12060 pg_stats_ext cC 0 |
12064 _pg_stats_ext_exprs bA 12065 | 12065 pg_stats_ext_exprs cC 0 |
12069 _pg_publication_tables bA 12070 | 12070 pg_publication_tables cC 0 |
12074 _pg_locks bA 12075 | 12075 pg_locks cC 0 | 12078 _pg_cursors bA 12079 |
12079 pg_cursors cC 0 | 12082 _pg_available_extensions bA 12083 |
12083 pg_available_extensions cC 0 | 12086 _pg_available_extension_versions bA 12087 |
12087 pg_available_extension_versions cC 0 | 12091 _pg_prepared_xacts bA 12092 |
12092 pg_prepared_xacts cC 0 | 12096 _pg_prepared_statements bA 12097 |
12097 pg_prepared_statements cC 0 | 12100 _pg_seclabels bA 12101 |
12101 pg_seclabels cC 0 | 12105 _pg_settings bA 12106 | 12106 pg_settings cC 0 |
12111 _pg_file_settings bA 12112 | 12112 pg_file_settings cC 0 |
12115 _pg_hba_file_rules bA 12116 | 12116 pg_hba_file_rules cC 0 |
12119 _pg_ident_file_mappings bA 12120 | 12120 pg_ident_file_mappings cC 0 |
12123 _pg_timezone_abbrevs bA 12124 | 12124 pg_timezone_abbrevs cC 0 |
12127 _pg_timezone_names bA 12128 | 12128 pg_timezone_names cC 0 |
12131 _pg_config bA 12132 | 12132 pg_config cC 0 | 12135 _pg_shmem_allocations bA 12136 |
12136 pg_shmem_allocations cC 0 | 12139 _pg_backend_memory_contexts bA 12140 |
12140 pg_backend_memory_contexts cC 0 | 12143 _pg_stat_all_tables bA 12144 |
12144 pg_stat_all_tables cC 0 | 12148 _pg_stat_xact_all_tables bA 12149 |
12149 pg_stat_xact_all_tables cC 0 | 12153 _pg_stat_sys_tables bA 12154 |
12154 pg_stat_sys_tables cC 0 | 12158 _pg_stat_xact_sys_tables bA 12159 |
12159 pg_stat_xact_sys_tables cC 0 | 12162 _pg_stat_user_tables bA 12163 |
12163 pg_stat_user_tables cC 0 | 12167 _pg_stat_xact_user_tables bA 12168 |
12168 pg_stat_xact_user_tables cC 0 | 12171 _pg_statio_all_tables bA 12172 |
12172 pg_statio_all_tables cC 0 | 12176 _pg_statio_sys_tables bA 12177 |
12177 pg_statio_sys_tables cC 0 | 12180 _pg_statio_user_tables bA 12181 |
12181 pg_statio_user_tables cC 0 | 12184 _pg_stat_all_indexes bA 12185 |
12185 pg_stat_all_indexes cC 0 | 12189 _pg_stat_sys_indexes bA 12190 |
12190 pg_stat_sys_indexes cC 0 | 12193 _pg_stat_user_indexes bA 12194 |
12194 pg_stat_user_indexes cC 0 | 12197 _pg_statio_all_indexes bA 12198 |
12198 pg_statio_all_indexes cC 0 | 12202 _pg_statio_sys_indexes bA 12203 |
12203 pg_statio_sys_indexes cC 0 | 12206 _pg_statio_user_indexes bA 12207 |
12207 pg_statio_user_indexes cC 0 | 12210 _pg_statio_all_sequences bA 12211 |
12211 pg_statio_all_sequences cC 0 | 12215 _pg_statio_sys_sequences bA 12216 |
12216 pg_statio_sys_sequences cC 0 | 12219 _pg_statio_user_sequences bA 12220 |
12220 pg_statio_user_sequences cC 0 | 12223 _pg_stat_activity bA 12224 |
12224 pg_stat_activity cC 0 | 12228 _pg_stat_replication bA 12229 |
12229 pg_stat_replication cC 0 | 12233 _pg_stat_slru bA 12234 | 12234 pg_stat_slru cC 0 |
12237 _pg_stat_wal_receiver bA 12238 | 12238 pg_stat_wal_receiver cC 0 |
12241 _pg_stat_recovery_prefetch bA 12242 | 12242 pg_stat_recovery_prefetch cC 0 |
12245 _pg_stat_subscription bA 12246 | 12246 pg_stat_subscription cC 0 |
12250 _pg_stat_ssl bA 12251 | 12251 pg_stat_ssl cC 0 | 12254 _pg_stat_gssapi bA 12255 |
12255 pg_stat_gssapi cC 0 | 12258 _pg_replication_slots bA 12259 |
12259 pg_replication_slots cC 0 | 12263 _pg_stat_replication_slots bA 12264 |
12264 pg_stat_replication_slots cC 0 | 12267 _pg_stat_database bA 12268 |
12268 pg_stat_database cC 0 | 12272 _pg_stat_database_conflicts bA 12273 |
12273 pg_stat_database_conflicts cC 0 | 12276 _pg_stat_user_functions bA 12277 |
12277 pg_stat_user_functions cC 0 | 12281 _pg_stat_xact_user_functions bA 12282 |
12282 pg_stat_xact_user_functions cC 0 | 12286 _pg_stat_archiver bA 12287 |
12287 pg_stat_archiver cC 0 | 12290 _pg_stat_bgwriter bA 12291 |
12291 pg_stat_bgwriter cC 0 | 12294 _pg_stat_wal bA 12295 | 12295 pg_stat_wal cC 0 |
12298 _pg_stat_progress_analyze bA 12299 | 12299 pg_stat_progress_analyze cC 0 |
12303 _pg_stat_progress_vacuum bA 12304 | 12304 pg_stat_progress_vacuum cC 0 |
12308 _pg_stat_progress_cluster bA 12309 | 12309 pg_stat_progress_cluster cC 0 |
12313 _pg_stat_progress_create_index bA 12314 | 12314 pg_stat_progress_create_index cC 0 |
12318 _pg_stat_progress_basebackup bA 12319 | 12319 pg_stat_progress_basebackup cC 0 |
12323 _pg_stat_progress_copy bA 12324 | 12324 pg_stat_progress_copy cC 0 |
12328 _pg_user_mappings bA 12329 | 12329 pg_user_mappings cC 0 |
12333 _pg_replication_origin_status bA 12334 | 12334 pg_replication_origin_status cC 0 |
12337 _pg_stat_subscription_stats bA 12338 | 12338 pg_stat_subscription_stats cC 0
| 2275 cstring pP 0
"""


def _parse_table(table: str) -> dict[int, PgType]:
    types: dict[int, PgType] = {}
    for entry in table.replace("\n", " ").split("|"):
        fields = entry.split()
        if not fields:
            continue
        oid = int(fields[0])
        types[oid] = PgType(
            oid=oid,
            namespace="pg_catalog",
            name=fields[1],
            kind=fields[2][0],
            category=fields[2][1],
            element_oid=int(fields[3]),
            base_oid=0,
            base_modifier=-1,
            delimiter=fields[4] if len(fields) > 4 else ",",
        )
    return types


#: Every built-in ``pg_catalog`` type (base, range, multirange, composite and arrays).
BUILTIN_TYPES: dict[int, PgType] = _parse_table(_TABLE)


class StaticCatalog:
    """Built-in types plus explicitly given ones (tests, or types learned from the server)."""

    def __init__(self, extra: dict[int, PgType] | None = None) -> None:
        self._types: dict[int, PgType] = dict(BUILTIN_TYPES)
        if extra:
            self._types.update(extra)

    def add(self, pg_type: PgType) -> None:
        """Register (or replace) one type."""
        self._types[pg_type.oid] = pg_type

    def lookup(self, oid: int) -> PgType:
        try:
            return self._types[oid]
        except KeyError:
            raise KeyError(f"unknown PostgreSQL type oid {oid}") from None
